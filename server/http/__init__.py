"""The server's ASGI middlewares: request bodies and text, security headers, hosts and
origins, the token and per-client admission, request slots, and back-pressure."""
