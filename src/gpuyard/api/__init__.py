"""The REST API (FastAPI): thin routes over the library's services."""
