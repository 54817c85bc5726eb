"""An OpenAI-compatible server over the engine session (continuous batching, a deployed policy, metrics).

    python -m engine.serve policy=static-4 port=8000        # see engine/serve/__main__.py

protocol.py (schemas, validation) -> app.py (FastAPI routes) -> scheduler.py (the batching thread over one
`engine.runtime.session.Session`) -> metrics.py (Prometheus, vLLM names).
"""
