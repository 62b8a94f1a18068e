"""Data: datasets.py (`load_data` for every data set, the image sets, the resumable loader), text.py (the
language model's text: documents, vocabulary, next-token windows), tokens.py (prepare-text's BPE token files) and
bundle.py (DataBundle and DataError, which every loader returns and raises). Imports only lab.core."""
