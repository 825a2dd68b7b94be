"""Text Generation Inference (TGI) compatible routes: /generate, /generate_stream, /info and POST /."""
