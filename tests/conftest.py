"""Fixtures: one real nats-server + SeaweedFS per test session, on ports chosen as they bind, stopped by pid."""

from __future__ import annotations

# Imported now, not by hypothesis's own plugin at the end of a session that never used it: that late
# import compiles hypothesis deep inside pytest's hooks, where CPython 3.11.7 can fail with "AST
# constructor recursion depth mismatch" and turn a passing run's exit code into 1.
import hypothesis  # noqa: F401
import pytest

from infra import stack
from infra.stack import StackSettings
from infra.streams import apply
from pipeline.eventlog import EventLog
from pipeline.logs import configure_logging
from tests.servers import new_run_id, start_stack


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the codec's kernels once, up front (10-30 s on a fresh machine, then numba's cache):
    otherwise the first test or island subprocess to touch a patch pays it inside its own wait."""
    from pipeline.codec.warm import warm

    warm()


@pytest.fixture(scope="session")
def stack_session(tmp_path_factory: pytest.TempPathFactory) -> StackSettings:
    configure_logging("tests", fmt="json", level="WARNING")
    settings = start_stack(tmp_path_factory.mktemp("stack"))
    try:
        yield settings
    finally:
        stack.down(settings)


@pytest.fixture
def settings(stack_session: StackSettings) -> StackSettings:
    """Session stack, fresh run id: tests share servers but never a subject or consumer."""
    return stack_session.model_copy(update={"run_id": new_run_id()})


@pytest.fixture
async def event_log(settings: StackSettings) -> EventLog:
    log = await EventLog.connect(settings, worker="test")
    await apply(log.js, settings.streams, settings.run_id)
    try:
        yield log
    finally:
        await log.close()
