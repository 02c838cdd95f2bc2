"""The rollouts of a seed do not change: tokens and log-probs of fixed prompts, seeds and sampling settings against
a golden file written by the decode loop whose draws ran outside the step (``tests/tasks/decode_golden.json``).

The step's draw, record and advance now run as one function that the CUDA graph captures and the CPU calls
eagerly; the noise's constants became tensors and its step keys come from a step counter on the device; attention
reads only the cache's used width. None of that may change a token (or a log-prob beyond float rounding) for a
given seed: a run resumed or repeated draws what it drew before.

Write the file again (only when the draws are meant to change):
``PYTHONPATH=. python tests/tasks/test_decode_golden.py --write``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

from tasks.generation.decode import decode  # noqa: E402
from tasks.generation.decode_options import DecodeOptions  # noqa: E402
from tasks.generation.sampling import Sampling  # noqa: E402
from tasks.model.loading import build_tiny_model, build_tokenizer  # noqa: E402

GOLDEN = Path(__file__).with_name("decode_golden.json")
PROMPTS = ["Q: 1+2=?\n", "Q: 12*34-5=?\n", "Q: 9=?\n", "Q: 40-3*7=?\n", "Q: (3+4)*2-11+6=?\n"]
#: (name, sampling) pairs: greedy, plain, and the three cuts (top-k, top-p, both)
SETTINGS = {"greedy": None, "t1": Sampling(1.0), "t0.7-k5": Sampling(0.7, 5, 1.0),
            "t1.3-p0.8": Sampling(1.3, 0, 0.8), "t0.9-k8-p0.9": Sampling(0.9, 8, 0.9)}
#: the CPU's layout and the GPU's (buckets, a check every 3 steps, padded prompts) run eagerly
OPTIONS = {"cpu": DecodeOptions.for_device("cpu"),
           "buckets": DecodeOptions(graphs=False, exact_rows=False, check_every=3, prompt_multiple=16)}


def rollouts(layouts: dict[str, DecodeOptions] = OPTIONS,
             settings: dict[str, Sampling | None] = SETTINGS) -> dict[str, dict[str, list]]:
    """Every (setting, layout): 5 prompts x 3 rollouts x up to 14 tokens of a tiny Llama whose EOS is likely (rows
    end at different steps), seeds 7 b + 1."""
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0).eval()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 3
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    out = {}
    for name, sampling in settings.items():
        for layout, options in layouts.items():
            ids, logp = decode(model, enc["input_ids"], enc["attention_mask"], n=3, max_new_tokens=14,
                               sampling=sampling, stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id,
                               seeds=torch.arange(len(PROMPTS)) * 7 + 1, options=options)
            out[f"{name}/{layout}"] = {"ids": ids.tolist(), "logp": logp.tolist()}
    return out


@pytest.fixture(scope="module")
def now():
    return rollouts()


@pytest.mark.parametrize("key", [f"{s}/{o}" for s in SETTINGS for o in OPTIONS])
def test_the_rollouts_of_a_seed_are_the_golden_ones(now, key):
    want = json.loads(GOLDEN.read_text())[key]
    got = now[key]
    assert got["ids"] == want["ids"]
    torch.testing.assert_close(torch.tensor(got["logp"]), torch.tensor(want["logp"]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_attention_over_the_used_width_keeps_the_golden_tokens(name):
    """The GPU's layout with attention over the used width (steps of 16 columns): the masked columns it no longer
    reads added exact zeros, so the tokens are the golden ones and the log-probs equal them to float rounding."""
    options = DecodeOptions(graphs=False, exact_rows=False, check_every=3, prompt_multiple=16, width_multiple=16)
    got = rollouts({"widths": options}, {name: SETTINGS[name]})[f"{name}/widths"]
    want = json.loads(GOLDEN.read_text())[f"{name}/buckets"]
    assert got["ids"] == want["ids"]
    torch.testing.assert_close(torch.tensor(got["logp"]), torch.tensor(want["logp"]), atol=1e-5, rtol=0)


def test_the_golden_rollouts_vary():
    """The golden file is no trivial one: rows of different lengths, settings that differ."""
    gold = json.loads(GOLDEN.read_text())
    lens = {len([t for t in row if t != 0]) for row in gold["t1/cpu"]["ids"]}
    assert len(lens) >= 3
    assert len({json.dumps(v["ids"]) for k, v in gold.items() if k.endswith("/cpu")}) == len(SETTINGS)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: PYTHONPATH=. python tests/tasks/test_decode_golden.py --write")
    GOLDEN.write_text(json.dumps(rollouts()) + "\n")
    print(f"wrote {GOLDEN}")
