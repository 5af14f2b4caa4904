"""Stream a chat completion from the example's server with the openai client (waits for the server).

The server's key comes from $GPUYARD_SERVE_KEY (the key `gpuyard serve` was started with) or
$OPENAI_API_KEY (the openai client's own variable).
"""

from __future__ import annotations

import os
import sys
import time

import httpx
from openai import OpenAI

url, model = sys.argv[1], sys.argv[2]
key = os.environ.get("GPUYARD_SERVE_KEY") or os.environ.get("OPENAI_API_KEY")
if not key:
    sys.exit("set GPUYARD_SERVE_KEY to the key the server was started with (or printed)")
deadline = time.time() + 120
while True:
    try:
        if (
            httpx.get(url + "/models", timeout=2, headers={"Authorization": f"Bearer {key}"}).status_code
            == 200
        ):
            break
    except httpx.HTTPError:
        pass
    if time.time() > deadline:
        sys.exit(f"{url}: the server did not answer within 120 s")
    time.sleep(0.5)
client = OpenAI(base_url=url, api_key=key)
question = "where is the red fox?"
print(f"user: {question}\nassistant: ", end="", flush=True)
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": question}],
    max_tokens=24,
    temperature=0,
    stream=True,
    stop=["<|user|>"],
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()
