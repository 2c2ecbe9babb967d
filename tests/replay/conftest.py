"""The agent's fixtures (offline spool per test, errors the guard swallowed fail the test,
one torch thread), shared with tests/agent."""

from tests.agent.conftest import _one_thread, agent_errors, attach, offline, spool_dir

__all__ = ["_one_thread", "agent_errors", "attach", "offline", "spool_dir"]
