"""Optional integrations with other libraries; each module imports its library on use.

- ``gqakv.integrations.transformers``: Hugging Face transformers (``pip install 'gqakv[transformers]'``).
"""
