"""Runs SGLang's own code in a separate process and prints JSON (importing sglang patches transformers,
so the test process never imports it).

    python tests/serving/sglang_reference.py frontend URL   # gen / select / run_batch against a server
    python tests/serving/sglang_reference.py auth           # decide_request_auth over a grid (stdin: cases)
"""
import json
import os
import subprocess
import sys

INSTALL = "pip install --no-deps sglang==0.5.23 && pip install pybase64 msgspec pyzmq ipython"


def import_problem() -> str | None:
    """None when SGLang's frontend imports in a fresh interpreter; else its last error line (a test
    skips with it: the tests run SGLang only where it can be imported, as the issue asks)."""
    proc = subprocess.run([sys.executable, "-c", "import sglang, sglang.srt.utils.auth"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    return f"sglang's frontend cannot be imported ({lines[-1] if lines else proc.returncode}): {INSTALL}"


def frontend(url: str) -> dict:
    import sglang as sgl

    sgl.set_default_backend(sgl.RuntimeEndpoint(url))

    @sgl.function
    def program(s, question):
        s += "Q: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=12, stop=["\n", "."], temperature=0)
        s += "\nDigits: " + sgl.gen("digits", regex=r"[0-9]{3}", max_tokens=8, temperature=1.0)
        s += "\nPick: " + sgl.select("pick", choices=["yes", "no", "maybe"])
        s += sgl.gen("tail", max_tokens=6, stop_regex=r"[0-9]", temperature=0.7)

    def summary(state) -> dict:
        return {"answer": state["answer"], "answer_tokens": state.get_meta_info("answer")["completion_tokens"],
                "digits": state["digits"], "pick": state["pick"], "tail": state["tail"],
                "tail_finish": state.get_meta_info("tail")["finish_reason"],
                "tail_tokens": state.get_meta_info("tail")["completion_tokens"]}

    first = program.run(question="What is one plus one?")
    again = program.run(question="What is one plus one?")
    batch = program.run_batch([{"question": q} for q in ("a?", "b?", "c?")], temperature=0)
    return {"version": sgl.__version__, "first": summary(first), "again": summary(again),
            "batch": [summary(s) for s in batch]}


def auth(cases: list) -> list:
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    return [decide_request_auth(method="POST", path=path, authorization_header=header, api_key=key,
                                admin_api_key=admin,
                                auth_level=AuthLevel.ADMIN_OPTIONAL if admin_route else AuthLevel.NORMAL).allowed
            for path, header, key, admin, admin_route in cases]


if __name__ == "__main__":
    if sys.argv[1] == "frontend":
        print(json.dumps(frontend(sys.argv[2])))
    else:
        print(json.dumps(auth(json.load(sys.stdin))))
