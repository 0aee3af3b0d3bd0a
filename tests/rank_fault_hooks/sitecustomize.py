"""A SIGKILL at an exact instruction of a trainer rank, for tests/test_trainer_ranks_faults.py.

Python imports `sitecustomize` at start-up from the path; a test puts this folder on PYTHONPATH of the
job it starts, so every process of the job (the launcher, torchrun, each rank) loads this file. It does
nothing unless one of these is set, each to "RANK:TEXT", and then acts in rank RANK of the job's first
attempt only (torchrun's TORCHELASTIC_RESTART_COUNT 0):

- SPRAWL_TEST_KILL_AFTER_PUT: the rank SIGKILLs itself right after its blob store has stored an object
  whose key contains TEXT, before the call returns (between a checkpoint's files and its event);
- SPRAWL_TEST_KILL_AFTER_APPEND: right after the log has acknowledged an event whose subject ends with
  TEXT (between a version's event and its metrics).

The moments a timed kill can only hope to hit. Nothing is faked: the store stores, the log appends,
then the process dies as a kill -9 would."""

import os

_PUT = os.environ.get("SPRAWL_TEST_KILL_AFTER_PUT")
_APPEND = os.environ.get("SPRAWL_TEST_KILL_AFTER_APPEND")


def _kill_after_append(suffix: str) -> None:
    import signal

    from pipeline.eventlog import EventLog
    from pipeline.subjects import subject_for

    append = EventLog.append

    async def wrapper(self, event, *args, **kwargs):
        result = await append(self, event, *args, **kwargs)
        if (kwargs.get("subject") or subject_for(event)).endswith(suffix):
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    EventLog.append = wrapper


def _kill_after_put(text: str) -> None:
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


def _mine(spec: str | None) -> str | None:
    """TEXT of a "RANK:TEXT" spec that names this process (a rank of the first attempt), else None."""
    if not spec or os.environ.get("RANK") is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    rank, text = spec.split(":", 1)
    return text if os.environ["RANK"] == rank else None


if (_text := _mine(_PUT)) is not None:
    _kill_after_put(_text)
if (_suffix := _mine(_APPEND)) is not None:
    _kill_after_append(_suffix)
