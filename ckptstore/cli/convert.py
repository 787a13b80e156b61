"""``ckptstore consolidate``, ``export`` and ``import``: a checkpoint to one process's,
to zarr v3 and back."""

from __future__ import annotations

import os

import click

from ..errors import CkptStoreError, InvalidURLError, NotACheckpointError
from ..storage import is_url, open_storage
from ..storage.urls import shown
from .common import EXIT_PROBLEM, EXIT_USAGE, _exists, _fail, _human_bytes, _print_json, _printable, _progress

# ---------------------------------------------------------------------------- consolidate
@click.command("consolidate")
@click.argument("src")
@click.argument("dst")
@click.option("--torch", "as_torch", is_flag=True, help="Write a torch.save file instead of a ckptstore checkpoint.")
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="Whose rank-local values (RNG state, counters) to keep.")
@click.option("--weights-only/--no-weights-only", default=True, show_default=True,
              help="Refuse pickled objects outside torch's allow-list (trust the source before disabling).")
def consolidate(src: str, dst: str, as_torch: bool, rank: int, weights_only: bool) -> None:
    """Write a single-process checkpoint (or with --torch a torch.save file) holding the
    full tensors of the sharded checkpoint SRC."""
    import torch

    from .. import api

    if _exists(dst):
        _fail(f"{shown(dst)}: already exists; consolidate never replaces a checkpoint", EXIT_USAGE)
    try:
        obj = _load_with_progress(src, "reading", False, map_location="cpu", weights_only=weights_only, rank=rank)
        if as_torch:
            with open(dst, "xb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
        else:
            api.save(obj, dst).result()
    except FileExistsError as e:
        _fail(f"{shown(dst)}: already exists ({e})", EXIT_USAGE)
    except (FileNotFoundError, InvalidURLError, NotACheckpointError) as e:  # (a store root: which step?)
        _fail(str(e), EXIT_USAGE)
    except CkptStoreError as e:
        _fail(str(e), EXIT_PROBLEM)
    click.echo(f"wrote {shown(dst)}")

# ---------------------------------------------------------------------------- zarr interop
@click.command("export")
@click.argument("src")
@click.argument("dest", type=click.Path())
@click.option("--zarr", "as_zarr", is_flag=True, required=True,
              help="Write a zarr v3 hierarchy through tensorstore (the one export format).")
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="Whose rank-local values to export (sharded tensors are exported whole).")
@click.option("--extension-types", is_flag=True,
              help="bfloat16 and float8 as tensorstore's extension types (bit for bit) instead of widened "
                   "exactly to float32/float16 (which every zarr reader opens).")
@click.option("--weights-only/--no-weights-only", default=True, show_default=True,
              help="Refuse pickled objects outside torch's allow-list (trust the source before disabling).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
def export(src: str, dest: str, as_zarr: bool, rank: int, extension_types: bool, weights_only: bool,
           as_json: bool) -> None:
    """Write every tensor of checkpoint SRC as a zarr v3 array below the new local
    directory DEST, with dtype and shape kept (docs/interop.md)."""
    from .. import zarr_io

    if os.path.lexists(dest):
        _fail(f"{dest}: already exists; export never writes into an existing path", EXIT_USAGE)
    try:
        state = _load_with_progress(src, "reading", as_json, map_location="cpu", weights_only=weights_only,
                                    rank=rank)
        total = sum(t.numel() * t.element_size() for t in _tensors_of(state))
        with _progress(total, "exporting", as_json) as bar:
            report = zarr_io.export_state(state, dest, extension_types=extension_types, source=src,
                                          on_bytes=bar.update)
    except (FileNotFoundError, InvalidURLError, NotACheckpointError) as e:  # (a store root: which step?)
        _fail(str(e), EXIT_USAGE)
    except CkptStoreError as e:
        _fail(str(e), EXIT_PROBLEM)
    if as_json:
        _print_json({"dest": dest, "arrays": report.arrays, "values": report.values,
                     "skipped": report.skipped, "bytes": report.bytes})
        return
    for line in report.skipped:
        click.echo(f"skipped {_printable(line)}")
    click.echo(f"wrote {dest}: {len(report.arrays)} array(s), {_human_bytes(report.bytes)}, "
               f"{report.values} plain value(s)")

@click.command("import")
@click.argument("src")
@click.argument("dest")
def import_(src: str, dest: str) -> None:
    """Save the zarr v3 hierarchy at local directory SRC (an export, or any hierarchy of
    arrays) as a new ckptstore checkpoint DEST."""
    from .. import api, zarr_io

    if is_url(src) or not os.path.isdir(src):  # (checked here, not by click, which echoes a URL whole)
        _fail(f"{shown(src)}: not a local directory (import reads a zarr v3 hierarchy on local disk)", EXIT_USAGE)
    if _exists(dest):
        _fail(f"{shown(dest)}: already exists; import never replaces a checkpoint", EXIT_USAGE)
    try:
        state = zarr_io.import_state(src)
        api.save(state, dest).result()
    except CkptStoreError as e:
        _fail(str(e), EXIT_PROBLEM)
    click.echo(f"wrote {shown(dest)}: {len(_tensors_of(state))} tensor(s)")

def _load_with_progress(src: str, label: str, quiet: bool, **load_args):
    """``ckptstore.load(src)`` in one process (a sharded checkpoint whole: no warning for
    that), with a bar over the stored bytes it reads."""
    import warnings

    from .. import api
    from ..checkpoint.reader import on_bytes_read
    from ..checkpoint.manifests import latest_manifest

    try:
        total = latest_manifest(open_storage(src)).stored_bytes
    except NotACheckpointError:  # (a store root, say: load would search for what lies there again)
        raise
    except (CkptStoreError, ValueError, OSError):  # a single-file container, say: no total to show
        total = 0
    with _progress(total, label, quiet or not total) as bar:
        token = on_bytes_read.set(bar.update)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", api.WorldSizeChangedWarning)
                return api.load(src, **load_args)
        finally:
            on_bytes_read.reset(token)

def _tensors_of(state) -> list:
    from ..checkpoint.flatten import tensor_paths

    found, _ = tensor_paths(state)
    return [t for _, t in found.values()]
