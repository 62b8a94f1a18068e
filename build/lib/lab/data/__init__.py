"""Data: datasets.py (`load_data` for every data set, the image sets, the resumable loader) and text.py (the
language model's text: documents, vocabulary, next-token windows). Imports only lab.core."""
