"""The agent tests' fixtures: one torch thread, an offline per-test spool, and the guard
that fails a test on any error the agent swallowed."""

from tests.agent.conftest import _one_thread, agent_errors, offline, spool_dir

__all__ = ["_one_thread", "agent_errors", "offline", "spool_dir"]
