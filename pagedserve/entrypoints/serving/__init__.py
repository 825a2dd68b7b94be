"""What the OpenAI and TGI handlers share: error shapes, SSE framing, admission control and timeouts,
tokenization of request texts, token texts for logprobs, and route helpers."""
