"""Chat with SmolLM2-135M-Instruct through pagekv.Engine.

    python examples/python/chat_smollm2.py                 # interactive
    python examples/python/chat_smollm2.py --say "Hi" --say "Who are you?"

The model comes from the project's model cache (scripts/fetch-model.sh
smollm2 fetches it once; make run and make test do). Each turn is rendered
with the model's own chat template (ChatML here), streamed token by token,
and appended to the conversation; the earlier turns' KV blocks are found in
the prefix cache, so a turn computes only its new tokens (printed after it).
"""

import argparse
import os
import subprocess
import sys

import pagekv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model_path():
    path = os.environ.get("PAGEKV_SMOLLM2")
    if path:
        return path
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "fetch-model.sh"), "smollm2"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit("cannot find SmolLM2: " + r.stderr.strip())
    return r.stdout.strip()


def turn(engine, messages, out, **sampling):
    """Streams the assistant's reply to `messages` into `out`; returns (text, result)."""
    stream = engine.stream(engine.encode_chat(messages), **sampling)  # ends at the template's end of turn
    for update in stream:
        out.write(update["text"])
        out.flush()
    out.write("\n")
    return stream.result["text"], stream.result


def main(say=None, system="You are a helpful assistant.", max_tokens=128, temperature=0.0, seed=None,
         out=sys.stdout):
    """Runs the conversation (the `say` turns, or stdin's lines); returns the results of each turn."""
    results = []
    with pagekv.Engine(model_path(), kv_budget="64MiB") as engine:
        messages = [{"role": "system", "content": system}] if system else []
        out.write(f"(SmolLM2 through pagekv, template: {engine.chat_template_name}; empty line ends)\n")
        lines = iter(say) if say is not None else (line.rstrip("\n") for line in sys.stdin)
        for line in lines:
            if not line:
                break
            out.write(f"> {line}\n")
            messages.append({"role": "user", "content": line})
            text, result = turn(engine, messages, out, max_tokens=max_tokens, temperature=temperature, seed=seed)
            messages.append({"role": "assistant", "content": text})
            out.write(f"  [{result['prompt_tokens']} prompt tokens, {result['cached_prompt_tokens']} from the "
                      f"prefix cache; {len(result['tokens'])} generated, {result['finish']}]\n")
            results.append(result)
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--say", action="append", help="a user turn (repeatable); without it, read stdin")
    ap.add_argument("--system", default="You are a helpful assistant.")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int)
    a = ap.parse_args()
    main(a.say, a.system, a.max_tokens, a.temperature, a.seed)
