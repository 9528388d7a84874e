"""Offline jobs: encode records, store embeddings and Hadamard views, publish FAISS indexes."""
