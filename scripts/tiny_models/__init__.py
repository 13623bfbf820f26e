"""The tiny random-weight GGUF models the tests and benches run on, each written
byte-identical on every run (fixed seeds): a llama text model (llama), a BERT embedding
model (embedding) and a LLaVA-style vision projector for the text model (projector);
`scripts/make_tiny_model.py` writes any of them."""
