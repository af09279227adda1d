"""The OpenAI API as both fronts speak it: request and response bodies
(pydantic), errors in OpenAI's shape, and what a request does when its client
hangs up. Torch-free and engine-free, so that the gateway validates bodies
with the very models a replica uses without depending on the server."""
