"""Serving: continuous batching over the cache slots of one decoding batch (`engine`), the OpenAI-compatible HTTP
server over it (`serve`, `kdtree-jax serve`) and its concurrency benchmark client (`bench_serve`,
`kdtree-jax bench-serve`). Nothing is imported here: `serve` and `bench_serve` need the `serve` extra (FastAPI,
uvicorn, httpx), the rest of the package does not.
"""
