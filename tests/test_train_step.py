"""The step: non-finite guard, fp16 overflow accounting, clipping, schedule, metric cadence."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from trainer_kit import Recorder, markov_tokens, tiny_config

from model.callbacks import Callback
from model.checkpoint import load_checkpoint
from model.config import PrecisionConfig
from model.gpt import GPT
from model.optim import build_adamw, lr_at
from model.precision import resolve_precision
from model.step import TrainModule
from model.train import Trainer, train
from model.typed_config import ConfigError

TOKENS, VAL = np.split(markov_tokens(24_000, vocab=64), [20_000])
BAD_STEP = 3  # the step (1-based) whose loss or gradient is made non-finite


class Poison(Callback):
    """Makes step BAD_STEP non-finite and records weights and Adam state around it."""

    def __init__(self, where: str):
        self.where, self.hook = where, None

    def on_step_start(self, trainer) -> None:
        if trainer.step + 1 != BAD_STEP:
            return
        self.before = self._state(trainer)
        if self.where == "grad":
            trainer.scale_grad(float("nan"))
        else:  # NaN logits for this step's forward only
            self.hook = trainer.model.readout.register_forward_hook(lambda m, i, out: out * float("nan"))

    def on_step_end(self, trainer) -> None:
        if trainer.step == BAD_STEP:
            self.after = self._state(trainer)
            if self.hook is not None:
                self.hook.remove()

    @staticmethod
    def _state(trainer):
        weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        return weights, copy.deepcopy(trainer.optimizer.state_dict()["state"])


@pytest.mark.parametrize("where", ["grad", "loss"])
@pytest.mark.parametrize("implementation", ["auto", "foreach"])  # device-side skip / host check
def test_nonfinite_step_is_skipped_and_never_reaches_weights_or_checkpoint(tmp_path, where, implementation):
    poison = Poison(where)
    cfg = tiny_config(
        **{
            "train.steps": 5,
            "optim.implementation": implementation,
            "checkpoint.every_steps": 1,
            "checkpoint.milestones": [BAD_STEP],
        }
    )
    summary = train(cfg, TOKENS, VAL, tmp_path, [poison])

    (w0, adam0), (w1, adam1) = poison.before, poison.after
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    for p in adam0:  # moments and step count untouched
        for k in adam0[p]:
            assert torch.equal(adam0[p][k], adam1[p][k]), (p, k)
    assert summary["skipped"] == 1 and summary["overflows"] == 0
    assert math.isfinite(summary["final_loss"])
    ckpt = load_checkpoint(tmp_path / f"checkpoints/step_{BAD_STEP:08d}.pt")
    tensors = [*ckpt["model"].values(), *(t for s in ckpt["optimizer"]["state"].values() for t in s.values())]
    assert all(torch.isfinite(t).all() for t in tensors)


def test_fp16_loss_scale_overflows_are_counted_apart_from_skips_and_back_off():
    # A loss scale of 2^30 overflows fp16 gradients; the scaler halves it until steps go through.
    cfg = tiny_config(
        **{"train.steps": 25, "precision.mode": "fp16", "precision.emulate": "always", "precision.init_scale": 2.0**30}
    )
    rec = Recorder()
    summary = train(cfg, TOKENS, VAL, callbacks=[rec])
    scales = [v for _, v in rec.series("train/loss_scale")]
    assert summary["overflows"] >= 5 and summary["skipped"] == 0
    assert scales[-1] < 2.0**30 and scales == sorted(scales, reverse=True)
    losses = [v for _, v in rec.series("train/loss")]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("clip", [0.05, 100.0])
def test_logged_grad_norm_is_the_true_pre_clip_norm_and_clipping_bounds_it(clip):
    cfg = tiny_config(**{"optim.grad_clip": clip})
    torch.manual_seed(0)
    model = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size)
    x, y = torch.randint(0, 64, (2, 4, 16)), torch.randint(0, 64, (2, 4, 16))

    reference = copy.deepcopy(model)  # plain fp64 norm of the accumulated gradient
    for i in range(2):
        _, ce, _ = reference(x[i], y[i])
        (ce / 2).backward()
    true_norm = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in reference.parameters()))

    precision = resolve_precision(PrecisionConfig(), "cpu")
    optimizer = build_adamw(model, cfg.optim)
    scaler = precision.grad_scaler(cfg.precision)
    result = TrainModule(model, optimizer, scaler, precision, clip).step(1, [(x[0], y[0]), (x[1], y[1])])
    post_clip = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))

    assert result.grad_norm.item() == pytest.approx(true_norm, rel=1e-5)
    assert post_clip <= clip * (1 + 1e-5)
    if clip > true_norm:
        assert post_clip == pytest.approx(true_norm, rel=1e-6)


class HalveLrAt(Callback):
    def on_step_start(self, trainer) -> None:
        if trainer.step + 1 == 6:
            trainer.scale_lr(0.5)

    def on_step_end(self, trainer) -> None:
        self.group_lrs = {g["name"]: (g["lr"], g["lr_mult"]) for g in trainer.optimizer.param_groups}


def test_logged_learning_rate_follows_the_schedule_and_the_lr_scale_hook():
    cfg = tiny_config(
        **{"train.steps": 10, "schedule.warmup_steps": 3, "schedule.kind": "cosine", "mup.parametrization": "mup"}
    )  # μP: hidden matrices get lr × 1/m
    rec, halve = Recorder(), HalveLrAt()
    train(cfg, TOKENS, VAL, callbacks=[rec, halve])
    expected = [lr_at(s, cfg.optim.lr, 10, cfg.schedule) * (0.5 if s == 5 else 1.0) for s in range(10)]
    assert [v for _, v in rec.series("train/lr")] == pytest.approx(expected, rel=1e-12)
    assert expected[:3] == pytest.approx([cfg.optim.lr / 3, 2 * cfg.optim.lr / 3, cfg.optim.lr])
    last = rec.series("train/lr")[-1][1]
    assert {n: lr for n, (lr, _) in halve.group_lrs.items()} == pytest.approx(
        {n: last * mult for n, (_, mult) in halve.group_lrs.items()}
    )
    assert halve.group_lrs["hidden"][1] == pytest.approx(cfg.mup.base_width / cfg.model.d_model)


class DecayOnly(Callback):
    """Zero gradients every step, so Adam's update is exactly 0 and only weight decay moves a
    weight; vetoes step ``veto_at``. Keeps a hidden matrix before step 1 and after every step, and
    the scheduled LR of every step."""

    def __init__(self, veto_at: int):
        self.veto_at, self.weights, self.lrs = veto_at, [], []

    def on_step_start(self, trainer) -> None:
        trainer.scale_grad(0.0)
        if trainer.step == 0:
            self.weights.append(trainer.model.blocks[0].mlp.up.weight.detach().clone())

    def on_before_optimizer(self, trainer, pending) -> None:
        self.lrs.append(trainer.optimizer.param_groups[0]["lr"] / trainer.optimizer.param_groups[0]["lr_mult"])
        if pending.step == self.veto_at:
            pending.veto()

    def on_step_end(self, trainer) -> None:
        self.weights.append(trainer.model.blocks[0].mlp.up.weight.detach().clone())


DECAY_CFG = {
    "train.steps": 6,
    "optim.lr": 0.5,  # far from 1, so lr·wd and wd differ
    "optim.weight_decay": 0.1,
    "schedule.warmup_steps": 3,
    "schedule.kind": "cosine",
    "mup.parametrization": "mup",  # m = 1/4: hidden matrices get lr × 4
}


def test_independent_weight_decay_shrinks_by_exactly_one_minus_wd_per_step_whatever_the_lr():
    decay = DecayOnly(veto_at=4)
    train(tiny_config(**DECAY_CFG, **{"optim.weight_decay_mode": "independent"}), TOKENS, VAL, callbacks=[decay])
    assert len(set(decay.lrs)) == 5  # warmup, peak twice, cosine down to min_lr_ratio
    expected = decay.weights[0].clone()
    for step, after in enumerate(decay.weights[1:], start=1):
        if step != 4:  # the vetoed step leaves the weights bitwise, decay included
            expected.mul_(1 - 0.1)  # no × m under μP, no × lr
        assert torch.equal(after, expected), step


def test_coupled_weight_decay_shrinks_by_one_minus_lr_times_wd_per_step():
    decay = DecayOnly(veto_at=0)
    train(tiny_config(**DECAY_CFG), TOKENS, VAL, callbacks=[decay])
    w = decay.weights
    ratios = [(w[k + 1] / w[k])[w[k] != 0].mean().item() for k in range(6)]
    assert ratios == pytest.approx([1 - lr * 0.1 for lr in decay.lrs], rel=1e-6)  # μP: (lr/m)·(wd·m)


def test_metrics_arrive_at_their_cadence_with_finite_values():
    cfg = tiny_config(
        **{
            "train.steps": 6,
            "train.log_every": 2,
            "train.layer_stats_every": 3,
            "train.eval_every": 4,
            "model.z_loss": 1e-4,
        }
    )
    rec = Recorder()
    train(cfg, TOKENS, VAL, callbacks=[rec])
    namespaces = {step: sorted({k.split("/")[0] for k in m}) for step, m in rec.logs}
    assert namespaces == {2: ["train"], 3: ["stats"], 4: ["train", "val"], 6: ["stats", "train", "val"]}
    train_keys = {
        "train/loss",
        "train/z_loss",
        "train/grad_norm",
        "train/param_norm",
        "train/adam_v_norm",
        "train/update_ratio",
        "train/lr",
        "train/tokens_per_s",
        "train/skipped",
        "train/overflows",
        "train/vetoed",
    }
    stats_keys = {
        "stats/act_l2/block0",
        "stats/attn_logit_max/block1",
        "stats/logits/log_z",
        "stats/logits/max",
        "stats/grad_norm/block0",
        "stats/grad_norm/readout",
    }
    logged = dict(rec.logs)
    assert train_keys <= set(logged[2]) and stats_keys <= set(logged[3])
    assert all(math.isfinite(v) for m in logged.values() for v in m.values())
    assert logged[2]["train/z_loss"] > 0 and 0 < logged[2]["train/update_ratio"] < 1


# ----------------------------------------------------------------------------------------------
# precision.loss_shift: fp16's underflow condition with fp32 untouched
# ----------------------------------------------------------------------------------------------


def trained_with_shift(mode: str, shift: int, **dotted):
    """A 12-step run (clipping active: a clip below the gradient norm) and its per-step logs."""
    cfg = tiny_config(
        **{
            "precision.mode": mode,
            "precision.emulate": "always",
            "precision.loss_shift": shift,
            "optim.grad_clip": 0.05,
            "train.steps": 12,
            "train.log_every": 1,
            **dotted,
        }
    )
    recorder = Recorder()
    trainer = Trainer(cfg, TOKENS, VAL, [recorder])
    trainer.run()
    return trainer, recorder.logs


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_a_loss_shift_leaves_an_fp32_or_bf16_run_bitwise_unchanged_clip_and_adam_included(mode):
    plain, plain_logs = trained_with_shift(mode, 0)
    shifted, shifted_logs = trained_with_shift(mode, 20)
    assert max(m["train/grad_norm"] for _, m in plain_logs) > 0.05  # the clip acted
    for key in ("train/loss", "train/grad_norm"):
        assert [m[key] for _, m in plain_logs] == [m[key] for _, m in shifted_logs], key
    for (name, a), b in zip(plain.model.state_dict().items(), shifted.model.state_dict().values()):
        assert torch.equal(a, b), name


def zero_gradient_share(mode: str, shift: int) -> float:
    """The share of weight-gradient entries that are exactly zero after one backward pass."""
    cfg = tiny_config(
        **{
            "precision.mode": mode,
            "precision.emulate": "always",
            "precision.loss_scaling": False,
            "precision.loss_shift": shift,
        }
    )
    torch.manual_seed(0)
    model = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size)
    precision = resolve_precision(cfg.precision, "cpu")
    module = TrainModule(
        model,
        build_adamw(model, cfg.optim),
        precision.grad_scaler(cfg.precision),
        precision,
        0.0,
        loss_multiplier=cfg.precision.loss_multiplier,
    )
    span = cfg.model.seq_len + 1
    x = torch.from_numpy(TOKENS[: 16 * span].astype(np.int64)).view(16, span)
    module.forward_backward(1, [(x[:, :-1], x[:, 1:])])
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None and p.dim() == 2])
    return (grads == 0).float().mean().item()


def test_a_loss_shift_flushes_unscaled_fp16_gradients_to_zero_and_leaves_fp32_and_bf16_ones():
    assert zero_gradient_share("fp16", 24) > zero_gradient_share("fp16", 0) + 0.2  # measured: 1.0 against 0.15
    assert zero_gradient_share("fp32", 24) == zero_gradient_share("fp32", 0)
    assert zero_gradient_share("bf16", 24) == zero_gradient_share("bf16", 0)  # fp32's exponent range


def test_the_trainer_refuses_to_compile_an_emulated_precision():
    cfg = tiny_config(**{"train.compile": True, "precision.mode": "bf16", "precision.emulate": "always"})
    tokens = markov_tokens(2000)
    with pytest.raises(ConfigError, match="train.compile: true with bf16 \\(emulated"):
        Trainer(cfg, tokens, tokens)


@pytest.mark.parametrize(("shift", "ok"), [(-1, False), (0, True), (40, True), (41, False)])
def test_the_loss_shift_is_checked_at_both_ends_of_its_range(shift, ok):
    if ok:
        assert tiny_config(**{"precision.loss_shift": shift}).precision.loss_multiplier == 2.0**-shift
    else:
        with pytest.raises(ConfigError, match=f"precision.loss_shift: {shift}; an integer from 0 to 40"):
            tiny_config(**{"precision.loss_shift": shift})
