"""How people reach the engine: the command line (``cli``) and the OpenAI-compatible HTTP
server (``openai_server``, with ``engine_loop`` and ``protocol``; the optional extra
``paged_engine[server]``). Importing this package imports neither torch nor the server's
dependencies."""
