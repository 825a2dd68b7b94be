"""OpenAI tool calling, model-free: the request's tool fields (spec), the JSON schemas that force a call
under constrained decoding (constraint), tools and tool turns in the prompt (prompt), the calls
themselves (calls) and the parsers of calls from free model text (parsers/)."""
