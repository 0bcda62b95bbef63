"""Why a request's greedy tokens move with batch company (issue 32): where its computation parts.

    python bench/company_probe.py --platform nvidia --preset k3-slice --out company_probe.json   # H200
    python bench/company_probe.py --smoke --out /tmp/probe.json                                   # CPU, k3-tiny

For each of `--prompts` probe prompts A, the model (random weights drawn in memory, as
`--load-format dummy`) generates `--steps` greedy tokens for A alone, then runs A first among
`--others` other prompts teacher-forced on A's lone tokens (conformance's driver: whole prompts in
one prefill step, then decode steps; no graphs, so the hooks see every layer). Per step it
records the relative logit difference of A alone vs in the crowd and the lone top-two gap, and
per MoE layer the number of A's rows whose expert set differs (a routing flip), with the router's
top-k margin (k-th minus (k+1)-th biased score) of the lone run at those rows.

The question it answers: does a wide split (a crowd token that differs at a top-two gap far above
rounding noise) follow a routing flip (a discrete change, then amplified through the layers), or
does the logit difference grow without one (a kernel variant computing something else)?
Writes the JSON to --out and prints one line per probe prompt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the conformance driver, from a checkout


class RoutingRecorder:
    """Wraps every MoE layer's expert selection; while `prompt_len` is set, keeps the probe's rows'
    expert ids and top-k margins of each call, in call order (layers in order within a forward)."""

    def __init__(self, model):
        from k3.model.ffn import MoE

        self.prompt_len = 0
        self.perturb = False      # the crowd run's first router input: one element of the probe's first row up one ulp
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        for moe in self.layers:
            moe._select = self._wrap(moe, moe._select)

    def _wrap(self, moe, select):
        cfg = moe.cfg

        def recorded(h):
            if self.perturb and self.prompt_len and not self.calls:
                h = h.clone()                             # about one unit in the last place of h's dtype
                h[0, 0] = h[0, 0] * (1 + torch.finfo(h.dtype).eps)
            chosen = select(h)
            if self.prompt_len:
                # the probe is first in its batch: its whole prompt in the prefill step (the first
                # forward: one call per layer), then one row a decode step
                n = self.prompt_len if len(self.calls) < len(self.layers) else 1
                logits = moe.kernels.moe.router_logits(h[:n], moe.gate).float()
                scores = torch.sigmoid(logits) if cfg.moe_router_activation_func == "sigmoid" else logits.softmax(-1)
                if moe.e_score_correction_bias is not None:
                    scores = scores + moe.e_score_correction_bias.float()
                top = scores.topk(cfg.num_experts_per_token + 1, dim=-1).values
                margin = top[:, -2] - top[:, -1]                                        # [n]
                self.calls.append((chosen.ids[:n].sort(-1).values.cpu(), margin.cpu()))
            return chosen

        return recorded


def probe_prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randrange(4, 28))] for _ in range(count)]


def _recorded_run(recorder, model, platform, requests, steps: int, device, *, perturb: bool):
    """The driver's run of `requests` (the probe first) with the recorder on: (probe's trace, calls)."""
    from conformance.driver import run

    recorder.calls, recorder.prompt_len, recorder.perturb = [], len(requests[0].prompt), perturb
    try:
        traces = run(model, requests, steps=steps, chunk=None, slots=list(range(len(requests))), device=device,
                     platform=platform)
    finally:
        recorder.prompt_len = 0
    return traces[0], recorder.calls


def probe_one(model, recorder, platform, prompt, others, steps: int, device, perturb: bool = False) -> dict:
    from conformance.driver import Request

    alone, alone_calls = _recorded_run(recorder, model, platform, [Request(prompt)], steps, device, perturb=False)
    crowd, crowd_calls = _recorded_run(recorder, model, platform,
                                       [Request(prompt, forced=alone.tokens)] + [Request(p) for p in others],
                                       steps, device, perturb=perturb)
    layers = len(recorder.layers)
    per_step = []
    first_flip = None
    for step in range(steps):
        a, c = alone.logits[step], crowd.logits[step]
        top = a.topk(2).values
        flips = []
        for layer in range(layers):
            i = step * layers + layer
            ids_a, margin = alone_calls[i]
            ids_c, _ = crowd_calls[i]
            differs = (ids_a != ids_c).any(-1)
            if differs.any():
                flips.append({"layer": layer, "rows": int(differs.sum()),
                              "min_margin": float(margin[differs].min())})
                if first_flip is None:
                    first_flip = {"step": step, "layer": layer}
        per_step.append({"step": step, "rel_logit_diff": float((c - a).norm() / a.norm()),
                         "max_abs_logit_diff": float((c - a).abs().max()), "lone_top2_gap": float(top[0] - top[1]),
                         "crowd_token_differs": int(c.argmax()) != alone.tokens[step], "routing_flips": flips})
    margins = torch.cat([m for _, m in alone_calls])
    return {"prompt_len": len(prompt), "first_routing_flip": first_flip,
            "first_split_step": next((s["step"] for s in per_step if s["crowd_token_differs"]), None),
            "median_router_margin": float(margins.median()), "steps": per_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="company_probe.json")
    parser.add_argument("--platform", default="nvidia")
    parser.add_argument("--preset", default="k3-slice")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--others", type=int, default=40)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--override", default="{}", help="JSON of text-config fields to change (a narrower model)")
    parser.add_argument("--perturb-router", action="store_true",
                        help="the control: the crowd run's first router input gets one element one bf16 ulp up "
                             "(the experts see the original): how far a routing flip alone moves the logits")
    parser.add_argument("--smoke", action="store_true", help="k3-tiny on the CPU reference platform, tiny sizes")
    args = parser.parse_args()
    if args.smoke:
        args.platform, args.preset, args.prompts, args.others, args.steps = "reference", "k3-tiny", 2, 6, 3

    from k3.checkpoint.dummy import load_dummy_weights
    from k3.config import K3Config
    from k3.dtypes import torch_dtype
    from k3.platform import select_platform

    platform = select_platform(args.platform)
    device = platform.info.device
    from k3.presets import preset_dict

    top = preset_dict(args.preset)
    text = top.get("text_config", top)
    for key, value in json.loads(args.override).items():
        if isinstance(value, dict):
            text.setdefault(key, {}).update(value)
        else:
            text[key] = value
    cfg = K3Config.from_dict(top)
    model = platform.build_model(cfg, dtype=torch_dtype(args.dtype))
    load_dummy_weights(model, seed=0, progress=False)
    platform.process_weights(model)
    model.model.fold_weights()
    recorder = RoutingRecorder(model)
    everything = probe_prompts(cfg.vocab_size, args.prompts + args.others, seed=32)
    result = {"date": datetime.date.today().isoformat(), "platform": args.platform, "preset": args.preset,
              "dtype": args.dtype, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "override": json.loads(args.override),
              "perturb_router": args.perturb_router, "others": args.others, "steps": args.steps, "probes": []}
    for i in range(args.prompts):
        others = everything[args.prompts:]
        probe = probe_one(model, recorder, platform, everything[i], others, args.steps, device, perturb=args.perturb_router)
        result["probes"].append(probe)
        split = probe["first_split_step"]
        print(json.dumps({"probe": i, "first_split_step": split, "first_routing_flip": probe["first_routing_flip"],
                          "gap_at_split": None if split is None else probe["steps"][split]["lone_top2_gap"],
                          "rel_logit_diff_step0": round(probe["steps"][0]["rel_logit_diff"], 6),
                          "flips_step0": sum(f["rows"] for f in probe["steps"][0]["routing_flips"])}), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
