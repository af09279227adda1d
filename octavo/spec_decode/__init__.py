"""Speculative decoding: proposers guess the next tokens of a request cheaply;
the target model verifies all guesses of all requests in one forward
(``octavo/sample/rejection.py``). See ``proposer.py`` for the seam."""
