"""Talk to `deepinfer serve` with the official `openai` client, whole answers and streamed.

    deepinfer serve MODEL --served-model-name deepseek      # in one shell
    python examples/client_openai.py [--base-url http://127.0.0.1:8000/v1] [--model deepseek]
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first)")
    parser.add_argument("--api-key", default="none", help="the key `deepinfer serve --api-key` was given")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    messages = [{"role": "user", "content": "Write a haiku about inference engines."}]

    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens)
    message = answer.choices[0].message
    reasoning = getattr(message, "reasoning_content", None)
    if reasoning:
        print(f"[reasoning] {reasoning}\n")
    print(f"[answer] {message.content}")
    print(f"[usage] {answer.usage.prompt_tokens} prompt + {answer.usage.completion_tokens} completion tokens\n")

    print("[streamed] ", end="", flush=True)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens,
                                            stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    completion = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=args.max_tokens,
                                           temperature=0)
    print(f"\n[completion] {completion.choices[0].text}")


if __name__ == "__main__":
    main()
