"""What reading tool calls costs a streamed chat answer: CPU time per delta of each parser, fed
a two-call answer in pieces of about one token (4 characters), against the answer read whole.

    .venv/bin/python benchmarks/tool_parser_bench.py [--repeats 2000]
"""

from __future__ import annotations

import argparse
import time

from fulcrum.llm.tool_parsers import extract, new_parser

ARGUMENTS = '{"city": "Paris", "days": 2, "units": "metric", "notes": "bring an umbrella"}'
OUTPUTS = {
    "hermes": (
        f'Checking.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGUMENTS}}}\n'
        '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    ),
    "llama3_json": (
        f'{{"name": "get_weather", "parameters": {ARGUMENTS}}}; '
        '{"name": "now", "parameters": {}}'
    ),
    "mistral": (
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGUMENTS}}}, '
        '{"name": "now", "arguments": {}}]'
    ),
    "plain text": "The weather in Paris is mild today; bring an umbrella. " * 3,
}


def _ids() -> str:
    return "id"


def main() -> None:
    args = argparse.ArgumentParser()
    args.add_argument("--repeats", type=int, default=2000)
    repeats = args.parse_args().repeats
    print(f"{'output':<12} {'chars':>5} {'us/delta':>9} {'us/char':>8} {'whole us':>9}")
    for name, text in OUTPUTS.items():
        family = "hermes" if name == "plain text" else name
        pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
        start = time.perf_counter()
        for _ in range(repeats):
            parser = new_parser(family, _ids)
            for piece in pieces:
                parser.feed(piece)
            parser.finish()
        streamed_s = (time.perf_counter() - start) / repeats
        start = time.perf_counter()
        for _ in range(repeats):
            extract(new_parser(family, _ids), text)
        whole_s = (time.perf_counter() - start) / repeats
        print(
            f"{name:<12} {len(text):>5} {streamed_s / len(pieces) * 1e6:>9.2f} "
            f"{streamed_s / len(text) * 1e6:>8.3f} {whole_s * 1e6:>9.1f}"
        )


if __name__ == "__main__":
    main()
