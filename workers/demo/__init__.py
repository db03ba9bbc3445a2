"""`inferq demo`: a worker on the default model, a few chat jobs streamed live, their rows and history."""
