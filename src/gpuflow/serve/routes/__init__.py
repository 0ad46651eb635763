"""The HTTP routes, one module per API area, handlers at module level.

A handler reaches the server's state with ``ServerState.of(request)``, raises
``gpuflow.serve.errors.ApiError`` for any refusal, and, for an OpenAI generation route,
hands its prompt to ``openai.generate`` (``openai.py`` holds what every such route
shares). ``gpuflow.serve.app`` registers each module's ``router``.
"""
