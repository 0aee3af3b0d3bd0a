"""A SIGKILL at an exact instruction of a trainer rank, for tests/test_trainer_ranks_faults.py.

Python imports `sitecustomize` at start-up from the path; a test puts this folder on PYTHONPATH of the
job it starts, so every process of the job (the launcher, torchrun, each rank) loads this file. It does
nothing unless SPRAWL_TEST_KILL_AFTER_PUT is set to "RANK:TEXT": then the rank RANK of the job's first
attempt (torchrun's TORCHELASTIC_RESTART_COUNT 0) SIGKILLs itself right after its blob store has stored
an object whose key contains TEXT, before the call returns. The blob is stored, nothing after it ran:
the moment between a checkpoint's files and its event that a timed kill can only hope to hit.
Nothing of the blob store is faked: the store stores, then the process dies as a kill -9 would."""

import os

_SPEC = os.environ.get("SPRAWL_TEST_KILL_AFTER_PUT")


def _install(rank: str, text: str) -> None:
    import signal

    from pipeline.blobstore.s3 import S3BlobStore

    def killing(put):
        def wrapper(self, *args, **kwargs):
            ref = put(self, *args, **kwargs)
            key = args[1] if len(args) > 1 else kwargs.get("key")
            if key is not None and text in key:
                os.kill(os.getpid(), signal.SIGKILL)
            return ref

        return wrapper

    S3BlobStore.put_file = killing(S3BlobStore.put_file)
    S3BlobStore.put_bytes = killing(S3BlobStore.put_bytes)


if _SPEC and os.environ.get("RANK") is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    _rank, _text = _SPEC.split(":", 1)
    if os.environ["RANK"] == _rank:
        _install(_rank, _text)
