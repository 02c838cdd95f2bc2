"""The ledger: schema, idempotent truncation for resume, and the audit questions."""

from tasks.data.prompts import PromptRecord, prompt_id
from tasks.records.ledger import Ledger


def rec(q, a="1"):
    return PromptRecord(id=prompt_id(q, a), source="t", split="train", question=q, answer=a, level=2, reward="arith")


def test_why_and_round_and_truncate(tmp_path):
    with Ledger(tmp_path / "l.duckdb") as led:
        r1, r2 = rec("1+0=?"), rec("2-1=?")
        assert led.add_prompts("run", [r1, r2]) == 2
        assert led.add_prompts("run", [r1]) == 0
        for step in range(4):
            led.add_rows("selections", "run", [{"round": step // 2, "step": step, "prompt_id": r1.id,
                                                "selector": "dots", "weight": 0.5, "pred_success": 0.4}])
            led.add_rows("groups", "run", [{"step": step, "prompt_id": r1.id, "n": 8, "successes": 3,
                                            "mean_reward": 0.375, "kept": 8, "replayed": False, "from_step": step}])
        why = led.why("run", r1.id[:6], step=2)
        assert len(why) == 1 and why[0]["pred_success"] == 0.4 and why[0]["successes"] == 3
        assert why[0]["question"] == "1+0=?"
        assert [r["step"] for r in led.round_selection("run", 1)] == [2, 3]
        led.truncate_after("run", 1)
        assert [r["step"] for r in led.query("SELECT step FROM groups ORDER BY step")] == [0, 1]
    with Ledger(tmp_path / "l.duckdb", read_only=True) as led:
        assert len(led.prompts()) == 2
