"""Text in, text out from a Hugging Face checkpoint folder, decoded by the megakernel.

    python -m megart.generate --model /models/Llama-3.2-1B --prompt "The capital of France is" \\
        --max-new-tokens 64 [--weights fp8] [--json]

Greedy, with the folder's own tokenizer; tokens are printed as they decode and decoding stops at EOS. At
the end: time-to-first-token (prompt prefill + first token) and the decode rate in tokens/s, on stderr so
stdout stays the text. --json prints one JSON line instead (text, tokens, timings) and streams nothing.
"""
from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _args(argv):
    ap = argparse.ArgumentParser(prog="python -m megart.generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a local Hugging Face folder (config.json + safetensors)")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                    help="fp8: quantise o/gate/up/down to e4m3 on load")
    ap.add_argument("--max-seq", type=int, default=4096, help="KV cache capacity (prompt + new tokens)")
    ap.add_argument("--json", action="store_true", help="one JSON result line, no streaming")
    ap.add_argument("--device", default=None, help="default: cuda when available (cpu: the emulator, slow)")
    ap.add_argument("--nw", type=int, default=None, help="worker CTAs (default: one per SM)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = _args(argv)
    from .models import CheckpointError, from_pretrained
    try:
        m = from_pretrained(a.model, device=a.device, max_seq=a.max_seq, weights=a.weights, nw=a.nw)
        m.tokenizer            # load it now: a folder without one fails before any decoding
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stream = None
    if not a.json:
        def stream(piece):
            print(piece, end="", flush=True)
    try:
        text = m.generate_text(a.prompt, a.max_new_tokens, on_text=stream)
    except ValueError as e:       # a prompt longer than --max-seq, a token outside the vocabulary
        print(f"error: {e}", file=sys.stderr)
        return 2
    st = m.last_stats
    if a.json:
        print(json.dumps(dict(model=a.model, weights=a.weights, prompt_tokens=st.prompt_tokens,
                              new_tokens=st.new_tokens, tokens=m.last_ids, text=text, stopped=st.stopped,
                              ttft_ms=round(st.ttft_s * 1e3, 3), tokens_per_s=round(st.tokens_per_s, 2))))
    else:
        print()
        print(f"[{st.new_tokens} tokens, stopped at {st.stopped}; time to first token {st.ttft_s * 1e3:.1f} ms, "
              f"decode {st.tokens_per_s:.1f} tokens/s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
