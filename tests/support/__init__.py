"""Helpers the tests share; the product never imports this package."""
