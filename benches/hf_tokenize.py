"""The Hugging Face baseline of `benches/tokenize.rs`: transformers' `apply_chat_template` +
encode, timed on the very bodies the Rust bench times, in the same run.

Reads a JSON job on stdin: {"budget_s": float, "configs": [{"name", "dir", "template" (a file or
null for the tokenizer's own), "bodies": [{"key", "messages"}]}]}. Prints one JSON line per body:
{"name", "key", "p50_ms", "ids"} (`ids`: the token count, which the Rust side checks against its
own). Offline: tokenizers load from local directories only.
"""

import json
import sys
import time

from transformers import AutoTokenizer


def p50(samples):
    samples = sorted(samples)
    return samples[(len(samples) - 1) // 2]


def main() -> int:
    job = json.load(sys.stdin)
    budget = float(job["budget_s"])
    for config in job["configs"]:
        tok = AutoTokenizer.from_pretrained(config["dir"], local_files_only=True)
        template = None
        if config.get("template"):
            with open(config["template"], encoding="utf-8") as f:
                template = f.read()

        for body in config["bodies"]:
            messages = body["messages"]

            def once():
                text = tok.apply_chat_template(
                    messages,
                    chat_template=template,
                    tokenize=False,
                    add_generation_prompt=True,
                )
                return tok(text, add_special_tokens=False)["input_ids"]

            ids = once()  # warm-up
            samples = []
            start = time.perf_counter()
            while len(samples) < 3 or (time.perf_counter() - start < budget and len(samples) < 500):
                t = time.perf_counter()
                once()
                samples.append(time.perf_counter() - t)
            print(
                json.dumps(
                    {
                        "name": config["name"],
                        "key": body["key"],
                        "p50_ms": p50(samples) * 1e3,
                        "ids": len(ids),
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
