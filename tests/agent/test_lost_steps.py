"""A monitor that loses steps never reports success: flush() says so, the loss reaches
the server as dropped steps, and a run that received nothing is never shown healthy."""

from __future__ import annotations

import httpx
import torch

from ampwatch import agent
from tests.agent.factories import batches, bf16_loop, mlp


def _run(url: str, run_id: str) -> dict:
    reply = httpx.get(f"{url}/api/v1/runs/{run_id}", timeout=10)
    reply.raise_for_status()
    return reply.json()


def test_flush_is_false_when_the_worker_lost_every_step(live_server, spool_dir,
                                                        agent_errors) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    attachment = agent.attach(model, server=live_server.url, flush_interval=0.1)
    grads = next(c for c in attachment._watch.collectors if c.name == "grads")

    def broken_read(*args, **kwargs):  # the fault: what a DTensor grad used to do here
        raise RuntimeError(".numpy() is not supported for tensor subclasses")

    grads.read = broken_read
    bf16_loop(model, optimizer, batches(4))
    assert attachment.flush(timeout=10) is False
    run = _run(live_server.url, attachment.run_id)
    assert run["steps"] == 0 and run["status"] == "no_data"

    del grads.read  # the fault clears: later steps arrive, the loss is still counted
    bf16_loop(model, optimizer, batches(3))
    assert attachment.flush(timeout=10) is True
    assert attachment.detach(timeout=10) is True
    run = _run(live_server.url, attachment.run_id)
    assert run["steps"] == 3 and run["dropped_steps"] == 4 and run["status"] != "no_data"
    assert {site for site, _ in agent_errors} == {"worker.handle"}
    agent_errors.clear()
