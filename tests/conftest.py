"""Shared fixtures: small and generic, for every test file.

- ``storage``: one fresh, empty :class:`~ckptstore.storage.Storage` per backend in
  ``STORAGE_BACKENDS``; a test that takes it runs once per backend.
- ``tmp_ckpt``: a path (not yet created) where a test may save a checkpoint.
- ``memory_url``: a ``memory://`` URL unique to the test.
- ``observe_earlier_failures``: opt-in (``pytest.mark.usefixtures``); waits for saves
  other tests left in flight and observes failures they left unobserved, which would
  otherwise surface on this test's first ``save`` (ckptstore reports them there).
- at the end of the session, the same for the whole process (``pytest_sessionfinish``):
  a failed save that nobody observed makes ckptstore's report at exit end the process
  with status 1 (docs/architecture.md, "Errors from the background"), and tests leave
  such failures on purpose.

On a machine where torch sees a GPU but ckptstore's native CUDA path is off, tests that
skip for that reason ("native CUDA path off: ...") FAIL instead: a GPU node must not pass
on the fallback unnoticed. ``CKPTSTORE_TEST_NATIVE_CUDA_OPTIONAL=1`` lets them skip (a
build made with ``CKPTSTORE_CUDA=OFF`` on purpose).

Adding a backend (e.g. S3 on a moto server) is one entry in ``STORAGE_BACKENDS``: a
factory ``(request, tmp_path) -> Storage`` that calls ``pytest.skip(reason)`` when the
backend cannot run here and registers its own teardown with ``request.addfinalizer``.
"""

from __future__ import annotations

import os
import uuid
import warnings

import pytest

# The package warns once when it runs on its pure-torch fallback (no ckptstore._C): fine in tests.
warnings.filterwarnings("ignore", message=r"ckptstore\.native", category=RuntimeWarning)

import ckptstore  # noqa: E402
from ckptstore.errors import CkptStoreError  # noqa: E402
from ckptstore.storage import LocalStorage, MemoryStorage  # noqa: E402
from ckptstore.supervisor.quick_exit import skip_final_collections  # noqa: E402


NATIVE_CUDA_OPTIONAL_ENV = "CKPTSTORE_TEST_NATIVE_CUDA_OPTIONAL"
_NATIVE_CUDA_OFF = "native CUDA path off"  # the skip reason the GPU tests give


def _native_cuda_missing() -> str | None:
    """Why the native CUDA path is off on a machine with a GPU (None: fine here)."""
    import torch

    if os.environ.get(NATIVE_CUDA_OPTIONAL_ENV) == "1" or not torch.cuda.is_available():
        return None
    return ckptstore.native.cuda_off_reason()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and _NATIVE_CUDA_OFF in str(rep.longrepr):
        why = _native_cuda_missing()
        if why is not None:
            rep.outcome = "failed"
            rep.longrepr = (f"a GPU is present but ckptstore's native CUDA path is off ({why}); "
                            f"set {NATIVE_CUDA_OPTIONAL_ENV}=1 to allow that")


def _local_storage(request, tmp_path):
    return LocalStorage(tmp_path / "store")


def _memory_storage(request, tmp_path):
    return MemoryStorage()


def _s3_storage(request, tmp_path):
    # A fresh bucket prefix on the session's moto server (HTTP on 127.0.0.1).
    from s3util import s3_storage_factory

    return s3_storage_factory(request, tmp_path)


# name -> factory(request, tmp_path) -> Storage.
STORAGE_BACKENDS = {
    "local": _local_storage,
    "memory": _memory_storage,
    "s3": _s3_storage,
}


@pytest.fixture(scope="session")
def supervised_reference(tmp_path_factory) -> dict:
    """The final state of an uninterrupted supervised training run (tests/test_supervisor.py's
    job, checkpoints on local disk), which every interrupted run of test_supervisor and
    test_supervisor_s3 must end bit-identical to: made once per session, not per module
    (a 2-rank torchrun job: about 15 s on 2 cores)."""
    import torch
    from test_supervisor import Supervised

    tmp = tmp_path_factory.mktemp("reference")
    job = Supervised(tmp / "store", tmp)
    assert job.finish() == 0, job.output()[-3000:]
    return torch.load(job.final)


@pytest.fixture(params=sorted(STORAGE_BACKENDS))
def storage(request, tmp_path):
    """A fresh, empty store of each registered backend."""
    return STORAGE_BACKENDS[request.param](request, tmp_path)


@pytest.fixture
def tmp_ckpt(tmp_path):
    """A checkpoint path that does not exist yet."""
    return tmp_path / "ckpt"


@pytest.fixture
def memory_url():
    """A ``memory://`` URL no other test uses."""
    return f"memory://test-{uuid.uuid4().hex[:12]}/ckpt"


@pytest.fixture
def observe_earlier_failures():
    """Start the test with no unobserved background failure of earlier tests."""
    try:
        ckptstore.wait(timeout=60)
    except (CkptStoreError, TimeoutError):
        pass


def pytest_sessionfinish(session, exitstatus):
    """Observe what the tests left behind (``ckptstore.wait()`` observes every save it
    covers), so that pytest's exit status is its own, not ckptstore's exit report's."""
    try:
        ckptstore.wait(timeout=60)
    except Exception:  # noqa: BLE001 - failures tests left on purpose, of any type
        pass
    # pytest's own exit, a second sooner (ckptstore/supervisor/quick_exit.py): nothing of the
    # session needs the interpreter's last collections
    skip_final_collections()
