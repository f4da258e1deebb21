"""Query a vllm-usd server with the OpenAI client (see serve_and_query.sh).

    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse

from openai import BadRequestError, OpenAI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt="The capital of France is", max_tokens=24, temperature=0)
    print("completion:", repr(done.choices[0].text))
    try:
        stream = client.chat.completions.create(model=model, max_tokens=32, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": "Name three fruits."}])
        print("chat (streamed): ", end="")
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print()
    except BadRequestError as exc:  # a base model without a chat template
        print(f"chat: not available for this model ({exc.status_code})")


if __name__ == "__main__":
    main()
