"""Prism's web app: the chat page, share links and the OpenAI-compatible API, in one process with
the embedded engine. Data flows browser -> app -> engine:

- :mod:`app.settings`: command-line / ``PRISM_*`` settings;
- :mod:`app.model_loader`: picks the model and loads it in the background (``/healthz``);
- :mod:`app.chat`: the chat flow over the session store and the engine (no web code);
- :mod:`app.render`: HTML fragments (telemetry chips, lists, panels, the share view);
- :mod:`app.ui`: the Gradio page;
- :mod:`app.openai_api`: ``/v1/chat/completions`` and ``/v1/models``;
- :mod:`app.server`: the FastAPI app that serves all of it (``launch.py`` runs it).
"""
