"""The H-CLIP search service (FastAPI) and the `hclip` command line."""
