"""The C++ kernels (built with g++ on first use) and their Python loaders: LoRA rows, decode
attention, the GGUF-block linears and their panel helper, the norms and rope."""
