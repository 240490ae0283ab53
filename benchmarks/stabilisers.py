"""Measure what each stabiliser of spec section 6 does, with the project's own loss functions.

A tabular policy (one free logit vector per response position, vocabulary V) stands in for
the LLM, so every number below is about the objective and the optimizer, not a model. Each
scenario runs in seconds on CPU and prints a table; the defaults in ``learner/config.py``
cite these tables.

Scenarios:

1. ``drift``: B trajectories of 2 turns x 64 tokens whose log-ratios share parameters with
   heavy-tailed sensitivities (a linear stand-in for an LLM), turn-level advantages plus
   token noise, ``--updates`` AdamW steps on the same batch (an off-policy inner loop). Per objective: the largest token |log ratio| reached, approx KL (k1) to the
   behaviour policy and the share of tokens drifted more than 1 nat. Shows how far a single
   token can move inside an unclipped turn, with and without the token bound / dual clip.
2. ``stale``: the policy first takes ``--lag`` steps on other batches (staleness), then trains
   on a batch sampled ``lag`` versions ago. Behaviour-ratio PPO against decoupled PPO: share
   of tokens outside the clip range at the first update (their gradient is lost), and the
   KL of each update to the policy it started from (the trust region actually enforced).
3. ``adam``: a loss multiplier s against a learning-rate multiplier s under AdamW with
   gradient clipping: the step length relative to s = 1.

Usage: ``.venv/bin/python -m benchmarks.stabilisers [--updates 30] [--lag 4] [--seed 0]``
"""

from __future__ import annotations

import argparse
import time

import torch

from learner import losses

V = 16
TURN = 64


def make_batch(batch: int, gen: torch.Generator, logits: torch.Tensor):
    """Sampled tokens [B, T], their log-probs under ``logits`` [T, V], turn ids, mask, A."""
    t = logits.shape[0]
    probs = torch.softmax(logits, -1).expand(batch, t, V)
    tokens = torch.multinomial(probs.reshape(-1, V), 1, generator=gen).reshape(batch, t)
    mask = torch.ones(batch, t)
    turn_ids = (torch.arange(t) // TURN).expand(batch, t).clone()
    adv = torch.randn(batch, t, generator=gen)
    adv = (adv - adv.mean()) / adv.std()
    return tokens, mask, turn_ids, adv


def logp_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits, -1)  # [T, V]
    return lp.unsqueeze(0).expand(tokens.shape[0], -1, -1).gather(2, tokens[..., None])[..., 0]


OBJECTIVES = {
    "token ppo": dict(ratio_level="token"),
    "turn, no bound": dict(ratio_level="turn"),
    "turn, dual clip 3": dict(ratio_level="turn", clip_ratio_c=3.0),
    "turn, bound 1.0": dict(ratio_level="turn", token_log_ratio_bound=1.0),
    "turn, bound 0.4": dict(ratio_level="turn", token_log_ratio_bound=0.4),
    "turn, bound 0.2": dict(ratio_level="turn", token_log_ratio_bound=0.2),
}


def _linear_loss(logr, behaviour, adv, mask, turn_ids, options) -> losses.PolicyLossOutput:
    """The policy loss at log-ratios ``logr`` against the behaviour policy (eps 0.2)."""
    return losses.compute_policy_loss(
        behaviour + logr, behaviour, adv, mask, turn_ids,
        clip_eps_low=0.2, clip_eps_high=0.2, **options,
    )  # fmt: skip


def drift(updates: int, seed: int, lr: float) -> list[dict]:
    """Shared parameters with heavy-tailed token sensitivities: ``logp_t = behaviour_t +
    phi_t . theta`` (theta in R^32 starts at 0, so every ratio starts at 1). A few tokens
    with large ``||phi_t||`` move far for the same theta, as a few LLM tokens do."""
    rows = []
    for name, options in OBJECTIVES.items():
        gen = torch.Generator().manual_seed(seed)
        batch, length, dim = 16, 2 * TURN, 32
        scale = torch.exp(1.5 * torch.randn(batch, length, 1, generator=gen))  # lognormal
        phi = torch.randn(batch, length, dim, generator=gen) * scale / dim**0.5
        behaviour = -torch.rand(batch, length, generator=gen) * 3.0
        mask = torch.ones(batch, length)
        turn_ids = (torch.arange(length) // TURN).expand(batch, length).clone()
        turn_adv = torch.randn(batch, 2, generator=gen).repeat_interleave(TURN, dim=1)
        adv = turn_adv + 0.3 * torch.randn(batch, length, generator=gen)
        adv = (adv - adv.mean()) / adv.std()
        theta = torch.zeros(dim, requires_grad=True)
        opt = torch.optim.AdamW([theta], lr=lr, weight_decay=0.0)
        inputs = (behaviour, adv, mask, turn_ids, options)
        for _ in range(updates):
            out = _linear_loss(phi @ theta, *inputs)
            opt.zero_grad()
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_([theta], 1.0)
            opt.step()
        with torch.no_grad():
            logr = phi @ theta
            final = _linear_loss(logr, *inputs)
        rows.append(
            {
                "objective": name,
                "max |log ratio|": float(logr.abs().max()),
                "approx KL": float((-logr).mean()),
                ">1 nat": float((logr.abs() > 1.0).float().mean()),
                "clip ratio": float(final.metrics["clip_ratio"]),
            }
        )
    return rows


def stale(lag: int, seed: int, lr: float, updates: int) -> list[dict]:
    rows = []
    for mode in ("behavior", "decoupled"):
        gen = torch.Generator().manual_seed(seed)
        init = torch.randn(2 * TURN, V, generator=gen)
        tokens, mask, turn_ids, adv = make_batch(16, gen, init)
        behaviour = logp_of(init, tokens)
        logits = init.clone().requires_grad_(True)
        opt = torch.optim.AdamW([logits], lr=lr, weight_decay=0.0)
        for _ in range(lag):  # the learner moved on other batches meanwhile
            other = make_batch(16, gen, init)
            out = losses.compute_policy_loss(
                logp_of(logits, other[0]),
                logp_of(logits, other[0]).detach(),
                other[3],
                other[1],
                other[2],
                ratio_level="token",
                clip_eps_low=0.2,
                clip_eps_high=0.2,
            )
            opt.zero_grad()
            out.loss.backward()
            opt.step()
        with torch.no_grad():
            proximal = logp_of(logits, tokens)
        if mode == "decoupled":
            weights = losses.behavior_importance_weights(
                proximal, behaviour, mask, turn_ids, level="token", cap=2.0
            ).weights
            old = proximal
        else:
            weights, old = None, behaviour
        first_clip, step_kls = None, []
        for _ in range(updates):
            with torch.no_grad():
                before = logp_of(logits, tokens)
            out = losses.compute_policy_loss(
                logp_of(logits, tokens),
                old,
                adv,
                mask,
                turn_ids,
                ratio_level="token",
                clip_eps_low=0.2,
                clip_eps_high=0.2,
                behavior_weights=weights,
            )
            if first_clip is None:
                first_clip = float(out.metrics["clip_ratio"])
                outside = float(
                    ((logp_of(logits, tokens) - old).detach().exp() - 1)
                    .abs()
                    .gt(0.2)
                    .float()
                    .mean()
                )
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            with torch.no_grad():
                step_kls.append(float((before - logp_of(logits, tokens)).mean()))
        rows.append(
            {
                "objective": mode,
                "outside clip range at 1st update": outside,
                "clipped at 1st update": first_clip,
                "mean KL per update": sum(step_kls) / len(step_kls),
            }
        )
    return rows


def adam(seed: int, lr: float) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(1000, generator=gen) for _ in range(6)]
    for s in (1.0, 0.66, 0.5):
        for target in ("loss", "update"):
            param = torch.zeros(1000, requires_grad=True)
            opt = torch.optim.AdamW([param], lr=lr, weight_decay=0.0)
            for i, g in enumerate(grads):
                last = i == len(grads) - 1
                param.grad = g * (s if last and target == "loss" else 1.0) * 3.0
                torch.nn.utils.clip_grad_norm_([param], 1.0)
                before = param.detach().clone()
                scale = s if last and target == "update" else 1.0
                for group in opt.param_groups:
                    group["lr"] = lr * scale
                opt.step()
            step = float((param.detach() - before).norm())
            rows.append({"s": s, "target": target, "last step length": step})
    base = {r["target"]: r["last step length"] for r in rows if r["s"] == 1.0}
    for r in rows:
        r["relative to s=1"] = r["last step length"] / base[r["target"]]
    return rows


def show(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=30)
    parser.add_argument("--lag", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    start = time.perf_counter()
    show(
        f"drift: {args.updates} AdamW updates on one batch (lr {args.lr})",
        drift(args.updates, args.seed, args.lr),
    )
    show(f"stale: staleness {args.lag}, then 4 updates", stale(args.lag, args.seed, args.lr, 4))
    show(
        "adam: loss multiplier vs learning-rate multiplier (grad clip 1.0)",
        adam(args.seed, args.lr),
    )
    print(f"\n({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
