"""`azyx serve`: an OpenAI-compatible HTTP server for generation (GPT-2) and embeddings (BERT-family, MiniLM) that
any OpenAI client can use (`pip install 'azyx[serve]'`: Starlette, uvicorn, jinja2, prometheus_client).

    azyx serve --model DIR [--model DIR2] [--device c:0] [--slots 8] [--host 127.0.0.1] [--port 8000] [--api-key K]
    python -m azyx serve --model DIR

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="K")
    client.completions.create(model="DIR's name", prompt="Hello", max_tokens=16, stream=True)

Each `--model` is a Hugging Face model directory (config.json, model.safetensors, tokenizer files); its family is
read from config.json's `model_type`: "gpt2" serves /v1/completions and /v1/chat/completions, "bert" (and the
BERT-family types in `EMBEDDING_TYPES`) serves /v1/embeddings; give `--model` twice to serve one of each. A model's
name (the `model` field of requests, /v1/models) is its directory's name. See `azyx.serve.app` for the endpoints
and the server's behaviour.
"""

from azyx.serve.app import EMBEDDING_TYPES, GENERATION_TYPES, KEEP_ALIVE_S, ServeConfig, make_app

__all__ = ["EMBEDDING_TYPES", "GENERATION_TYPES", "KEEP_ALIVE_S", "ServeConfig", "make_app"]
