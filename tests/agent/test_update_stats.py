"""param_sums against the truth of a real optimizer step: the weights before and after,
and the optimizer's own state, read by this test in float64."""

from __future__ import annotations

import torch

from ampwatch.agent.update_stats import CHUNK, SUMS, _adam_update, _one, param_sums


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(), (3,), (7, 5)] + [(4,)] * (CHUNK + 40)  # past one chunk
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]


def _truth(before: torch.Tensor, p: torch.nn.Parameter, state: dict, group: dict
           ) -> dict[str, float]:
    """The step's sums in float64: AdamW's update from its state, as PyTorch defines it."""
    after, grad = p.detach().double(), p.grad.double()
    (beta1, beta2), eps, lr, step = group["betas"], group["eps"], group["lr"], state["step"]
    v = state["max_exp_avg_sq" if group["amsgrad"] else "exp_avg_sq"].double()
    bias1, bias2 = 1 - beta1 ** float(step), 1 - beta2 ** float(step)
    update = (lr * group["weight_decay"] * before.double()
              + lr * state["exp_avg"].double() / bias1 / ((v / bias2).sqrt() + eps))
    graded = grad != 0
    moved = 0.0
    if p.dtype == torch.bfloat16:  # AdamW's decay moves every nonzero weight too
        moved_mask = (state["exp_avg"] != 0) | (before != 0)
        moved = float(moved_mask.sum())
    return {"update_sq": float((update ** 2).sum()),
            "weight_sq": float((after ** 2).sum()), "moved": moved,
            "eps_dominated": float((((v / bias2).sqrt() < eps) & graded).sum()),
            "v_zero": float(((state["exp_avg_sq"] == 0) & graded).sum()),
            "grad_nonzero": float(graded.sum())}


def test_adam_sums_of_every_group_and_dtype_match_the_step() -> None:
    params = _params()
    low = [torch.nn.Parameter(torch.randn(64).to(torch.bfloat16)) for _ in range(3)]
    groups = [{"params": params[:100], "lr": 1e-2, "weight_decay": 0.1},
              {"params": params[100:], "lr": 3e-3, "eps": 1e-3, "amsgrad": True,
               "betas": (0.8, 0.95)},
              {"params": low, "lr": 1e-3}]
    optimizer = torch.optim.AdamW(groups)
    every = params + low
    for _ in range(3):
        for i, p in enumerate(every):
            p.grad = torch.randn_like(p) * (i % 7)  # every 7th parameter: zero gradient
            if i % 5 == 0 and p.dim():
                p.grad.view(-1)[0] = 0.0
        before = [p.detach().clone() for p in every]
        optimizer.step()
    rows, sums = param_sums(optimizer, "adam", {id(p): i for i, p in enumerate(every)})
    assert rows == list(range(len(every)))
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for row, (p, old) in enumerate(zip(every, before, strict=True)):
        truth = _truth(old, p, optimizer.state[p], group_of[id(p)])
        got = dict(zip(SUMS, sums[row].tolist(), strict=True))
        for name in ("weight_sq", "eps_dominated", "v_zero", "grad_nonzero"):
            assert abs(got[name] - truth[name]) <= 1e-6 * max(1.0, truth[name]), (row, name)
        # rounding is judged one ULP from the new weight (update_stats' docstring): the
        # per-parameter path, one parameter at a time, is the reference
        state, group = optimizer.state[p], group_of[id(p)]
        flat = {k: v.reshape(-1) if k != "step" else v for k, v in state.items()}
        one = _one(p.detach().reshape(-1), p.grad.reshape(-1),
                   *_adam_update(optimizer, group, p.detach().reshape(-1), flat, p.grad))
        assert got["lost"] == one[SUMS.index("lost")].item(), row
        assert got["moved"] == one[SUMS.index("moved")].item() == truth["moved"], row
        assert abs(got["update_sq"] - truth["update_sq"]) <= 1e-4 * truth["update_sq"], row


def test_sgd_and_adam_agree_on_a_plain_parameter() -> None:
    """SGD keeps the per-parameter path: the same sums as the step took."""
    p = torch.nn.Parameter(torch.randn(50))
    optimizer = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    for _ in range(2):
        p.grad = torch.ones_like(p)
        before = p.detach().clone()
        optimizer.step()
    rows, sums = param_sums(optimizer, "sgd", {id(p): 0})
    assert rows == [0]
    update_sq = float(((before - p.detach()).double() ** 2).sum())
    assert abs(sums[0, SUMS.index("update_sq")].item() - update_sq) <= 1e-5 * update_sq
