def parse_completion(text, thinking_mode): raise NotImplementedError
