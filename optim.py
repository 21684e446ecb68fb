"""The optimizers, AdamW (GPT-2's recipe) or Muon for the blocks' matrices beside AdamW (--optimizer muon), as one
Optimizers, and their learning-rate schedule. Build them after parallel.wrap_model: FSDP replaces the parameters with
shards."""

import math
from dataclasses import dataclass

import torch

from common import UserError

DEFAULT_WARMUP = 715  # build-nanogpt's 375M tokens of warm-up, as in the GPT-3 paper, at 2**19 tokens/step
DEFAULT_MUON_LR = 0.02  # Keller Jordan's Muon and nanochat's matrix learning rate (BENCHMARKS.md: the sweep)


class Flags:
    """This room's flags in the trainer's command line (train_config composes every room's): the schedule's and the
    optimizers', their ranges, their defaults that scale with the run, and the checks between them."""
    ranges = {**dict.fromkeys(("max_lr", "eps", "muon_lr"), "a positive number"),
              **dict.fromkeys(("beta1", "beta2", "muon_momentum"), "at least 0 and below 1"),
              "min_lr_ratio": "between 0 and 1", "warmup_steps": "0 or more", "weight_decay": "0 or more"}
    paths, fixed_on_resume = (), ("optimizer",)  # the other settings may change on resume (a lower rate, say)

    @staticmethod
    def add_flags(a):
        a("--max-lr", type=float, default=6e-4, help="peak learning rate (default: 6e-4)")
        a("--min-lr-ratio", type=float, default=0.1, help="final LR as a fraction of --max-lr (default: 0.1)")
        a("--lr-schedule", choices=["cosine", "wsd"], default="cosine",
          help="after warm-up: cosine decay (default), or wsd: hold the peak, then decay over the last 20%% of the run")
        a("--warmup-steps", type=int, help=f"linear warm-up steps (default: {DEFAULT_WARMUP}, or 10%% of --max-steps "
                                           "when that is fewer)")
        a("--optimizer", choices=["adamw", "muon"], default="adamw",
          help="adamw (default, GPT-2's recipe), or muon: Muon for the attention and MLP matrices, AdamW for the rest")
        a("--muon-lr", type=float, default=DEFAULT_MUON_LR,
          help=f"Muon's peak learning rate (default: {DEFAULT_MUON_LR})")
        a("--muon-momentum", type=float, default=0.95, help="Muon's Nesterov momentum (default: 0.95)")
        a("--weight-decay", type=float, default=0.1, help="AdamW weight decay on 2-D weights (default: 0.1)")
        a("--beta1", type=float, default=0.9, help="AdamW beta1 (default: 0.9)")
        a("--beta2", type=float, default=0.95, help="AdamW beta2 (default: 0.95)")
        a("--eps", type=float, default=1e-8, help="AdamW epsilon (default: 1e-8)")

    @staticmethod
    def flag_defaults(args):
        if args.warmup_steps is None:
            args.warmup_steps = min(DEFAULT_WARMUP, args.max_steps // 10)

    @staticmethod
    def check_flags(cfg, said):
        """The checks between this room's flags, on the resolved settings (a refusal: UserError); said(name): a
        setting as a refusal names it (as typed, or where its value came from)."""
        for flag in ("muon_lr", "muon_momentum"):
            if flag in cfg.given and cfg.optimizer != "muon":
                raise UserError(f"--{flag.replace('_', '-')} is a setting of --optimizer muon, and this run uses "
                                f"{cfg.optimizer}: add --optimizer muon, or drop it")
        if cfg.warmup_steps > cfg.max_steps:
            raise UserError(f"{said('warmup_steps')} is more than {said('max_steps')}: the run would end before the "
                            f"learning rate reaches its peak; pass --warmup-steps {cfg.max_steps // 10} (or another "
                            f"of at most {cfg.max_steps}), or raise --max-steps")

    @staticmethod
    def settle_flags(values, given):
        """What the resolved settings say for every reader: Muon's peak rate only where Muon trains."""
        if values["optimizer"] != "muon":
            values["muon_lr"] = None


@dataclass(frozen=True)
class Settings:
    """What the optimizers are built with: AdamW's peak rate and hyper-parameters, and, where muon_lr is set, Muon's
    for the model's matrices."""
    weight_decay: float
    max_lr: float
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    muon_lr: float | None = None  # None: AdamW trains every parameter
    muon_momentum: float = 0.95


def settings_of(cfg):
    """The optimizers' Settings from the trainer's (train_config's --max-lr, --weight-decay, --beta1, --beta2, --eps,
    --muon-lr and --muon-momentum)."""
    return Settings(cfg.weight_decay, cfg.max_lr, (cfg.beta1, cfg.beta2), cfg.eps, cfg.muon_lr, cfg.muon_momentum)


def configure(model, settings, device_type="cpu", fused=None, muon_dtype=torch.bfloat16):
    """The Optimizers of a GPT from its Settings: AdamW, weight decay on 2-D weights (matmuls, embeddings) only, fused
    on CUDA; with muon_lr, Muon (Nesterov, no weight decay, Newton-Schulz in muon_dtype) for the model's matrices
    beside it, as modded-nanogpt trains them."""
    s = settings
    matrices = model.matrices() if s.muon_lr is not None else []
    rest = [p for p in model.parameters() if not any(p is m for m in matrices)]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": s.weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    if fused is None:
        fused = device_type == "cuda"
    adamw = torch.optim.AdamW(groups, lr=s.max_lr, betas=s.betas, eps=s.eps, fused=fused)
    if not matrices:
        return Optimizers(adamw)
    muon = Muon(matrices, lr=s.muon_lr, momentum=s.muon_momentum, nesterov=True, weight_decay=0.0,
                ortho_dtype=muon_dtype)
    return Optimizers(muon, adamw)


def build(model, cfg, device_type, choice=None):
    """The run's Optimizers from the settings this room owns, read from the trainer's (cfg: settings_of's, and the
    schedule's); choice (device.Choice): what the device's Newton-Schulz runs in (bfloat16 where there is none)."""
    opt = configure(model, settings_of(cfg), device_type,
                    muon_dtype=choice.muon_dtype if choice is not None else torch.bfloat16)
    opt.cfg, opt.schedule = cfg, schedule_of(cfg)
    return opt


class Optimizers:
    """The run's optimizers as one, the same shape whether AdamW trains alone or Muon trains the model's matrices
    beside it: every other room steps, unscales, schedules and checkpoints them through this. Made by build(), it
    also holds the run's settings (cfg) and schedule, and answers for them: the rates at each step (at_step), the
    settings over a resumed state (settle), the header's line (describe) and the rates a diverged run lowers."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers
        self.cfg = self.schedule = None

    name = property(lambda self: "+".join(type(opt).__name__ for opt in self.optimizers))  # AdamW, Muon+AdamW

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def unscale_(self, scaler):
        """The gradient scaler's unscale_ of each (a no-op where it is off)."""
        for opt in self.optimizers:
            scaler.unscale_(opt)

    def set_lrs(self, schedule, step, max_lr, muon_lr=None):
        """Every group's learning rate at step, from its optimizer's peak (muon_lr or max_lr); AdamW's, for the log."""
        for opt in self.optimizers:
            peak = muon_lr if isinstance(opt, Muon) else max_lr
            for group in opt.param_groups:
                group["lr"] = schedule.lr(step, peak)
        return schedule.lr(step, max_lr)

    def at_step(self, step):
        """The run's rates at step (build's settings and schedule); AdamW's, for the log."""
        return self.set_lrs(self.schedule, step, self.cfg.max_lr, self.cfg.muon_lr)

    def settle(self):
        """The run's settings over the param groups a checkpoint brought back (a resume may change them)."""
        c = self.cfg
        self.apply_settings(c.weight_decay, (c.beta1, c.beta2), c.eps, c.muon_momentum)

    def describe(self, resumed=False):
        """The run header's line: the peak rates, the warm-up (a new run's default, 10% of a short run, says so) and
        the decay."""
        c, muon = self.cfg, [opt for opt in self.optimizers if isinstance(opt, Muon)]
        auto_warmup = not resumed and "warmup_steps" not in c.given and c.warmup_steps < DEFAULT_WARMUP
        matrices = f" (AdamW), Muon {c.muon_lr:g} on the block matrices" if muon else ""
        if muon and muon[0].ortho_dtype != torch.bfloat16:
            matrices += " (Newton-Schulz in float16: no bfloat16 on this GPU)"
        return (f"lr {c.max_lr:g}{matrices}: {c.warmup_steps} warm-up steps"
                f"{' (10% of --max-steps; --warmup-steps sets it)' if auto_warmup else ''}"
                f", {'cosine' if c.lr_schedule == 'cosine' else 'stable, then linear'} to "
                f"{c.max_lr * c.min_lr_ratio:g} at step {c.max_steps}")

    def rates(self):
        """The flags a run that diverged lowers: under Muon, either rate may be the cause."""
        return "--max-lr or --muon-lr" if any(isinstance(opt, Muon) for opt in self.optimizers) else "--max-lr"

    def apply_settings(self, weight_decay, betas, eps, muon_momentum=None):
        """These settings over what a loaded state dict brought back: a resume that changes them trains with the new
        ones. AdamW's first group is the decayed one."""
        for opt in self.optimizers:
            if isinstance(opt, Muon):
                if muon_momentum is not None:
                    for group in opt.param_groups:
                        group["momentum"] = muon_momentum
                continue
            for i, group in enumerate(opt.param_groups):
                group.update(weight_decay=weight_decay if i == 0 else 0.0, betas=tuple(betas), eps=eps)

    def state_bytes(self):
        """Bytes of state for the whole model, unsharded: AdamW's two fp32 moments, Muon's one momentum buffer."""
        return sum((4 if isinstance(opt, Muon) else 8) * p.numel() for opt in self.optimizers
                   for group in opt.param_groups for p in group["params"])

    def pack(self, states):
        """One state dict from each optimizer's: AdamW's own where it trains alone (as checkpoints have always held
        it), else {"optimizers": [...]} in order."""
        return states[0] if len(self.optimizers) == 1 else {"optimizers": list(states)}

    def unpack(self, state):
        """pack's inverse: each optimizer's state dict, in order."""
        return [state] if len(self.optimizers) == 1 else state["optimizers"]

    def state_dict(self):
        return self.pack([opt.state_dict() for opt in self.optimizers])

    def load_state_dict(self, state):
        for opt, part in zip(self.optimizers, self.unpack(state)):
            opt.load_state_dict(part)


class Muon(getattr(torch.optim, "Muon", torch.optim.Optimizer)):  # before 2.9, device.py stops with one line
    """torch.optim.Muon's step and state, its Newton-Schulz iteration in bfloat16 (torch's own) or float16 for GPUs
    without bf16 (the iteration keeps every entry within [-1, 1]); under FSDP each matrix is orthogonalised whole."""

    def __init__(self, params, ortho_dtype=torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ortho_dtype = ortho_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            momentum, lr = group["momentum"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = self.state[p]["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)  # as torch's: B = mu B + (1 - mu) g
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = self._orthogonalize(update, group)
                rows, cols = p.shape[:2]
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * max(1, rows / cols) ** 0.5)  # torch's "original" scaling
        return None

    def _orthogonalize(self, update, group):
        """Newton-Schulz on the whole matrix, a shard (FSDP's DTensor) gathered first and this rank's rows kept:
        on the shards DTensor would redistribute at every product of every iteration."""
        from torch.distributed.tensor import DTensor, Replicate
        whole = update.full_tensor() if isinstance(update, DTensor) else update
        args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        if self.ortho_dtype == torch.bfloat16:
            result = torch.optim._muon._zeropower_via_newtonschulz(whole, *args)  # torch.optim.Muon's own
        else:
            result = orthogonalize(whole, *args, self.ortho_dtype)
        if not isinstance(update, DTensor):
            return result
        mesh = update.device_mesh  # from a replicated tensor to shards: each rank takes its rows, no collective
        return DTensor.from_local(result, mesh, [Replicate()], run_check=False).redistribute(mesh, update.placements)


def local_part(t):
    """The tensor itself, or this rank's shard of a DTensor (an alias: writing it writes the DTensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


def orthogonalize(g, coefficients, steps, eps, dtype):
    """The quintic Newton-Schulz iteration of Keller Jordan's Muon, as torch.optim.Muon runs it, in `dtype`:
    g (2-D) mapped to roughly U V^T of its SVD (singular values pushed into ~[0.5, 1.5])."""
    a, b, c = coefficients
    # normalised before the cast: fp16's range ends at 6e-8, where small momentum entries would flush to zero
    x = (g / g.norm().clamp(min=eps)).to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T  # iterate on the wide orientation: the Gram matrix is the smaller one
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


@dataclass(frozen=True)
class Schedule:
    """The learning rate at each step for a peak rate: linear warm-up, then to min_lr_ratio * peak at max_steps by
    cosine decay (GPT-3, appendix B) or, shape "wsd", holding the peak and decaying linearly over the last WSD_DECAY
    of the run (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations")."""
    warmup_steps: int
    max_steps: int
    min_lr_ratio: float
    shape: str = "cosine"

    WSD_DECAY = 0.2

    def lr(self, step, peak):
        min_lr = peak * self.min_lr_ratio
        if step < self.warmup_steps:  # warmup_steps > 0 here
            return peak * (step + 1) / self.warmup_steps
        if self.shape == "wsd":
            decay_start = max(self.warmup_steps, self.max_steps - round(self.WSD_DECAY * self.max_steps))
            if step < decay_start:
                return peak
            return peak - (step - decay_start) / max(1, self.max_steps - decay_start) * (peak - min_lr)
        ratio = (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - min_lr)


def schedule_of(cfg):
    return Schedule(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio, cfg.lr_schedule)
