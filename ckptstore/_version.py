"""The package version, importable from any layer without importing the package root
(whose import order would otherwise decide whether it is defined yet)."""

__version__ = "0.1.0"
