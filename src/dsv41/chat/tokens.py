"""The V4.1 special-token strings, as they appear in prompt and completion text (MODEL.md §12.1).

The bars are U+FF5C FULLWIDTH VERTICAL LINE and the BOS/EOS spaces are U+2581; the tokenizer matches these
strings as single added tokens wherever they occur.
"""

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE = "<｜deepseek_image｜>"

# Quick-instruction tasks: the first five sit on a user message, `title` on an assistant message.
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "read_url": "<｜read_url｜>",
    "title": "<｜title｜>",
}
USER_TASKS = ("action", "query", "authority", "domain", "read_url")
ASSISTANT_TASKS = ("title",)

# DSML tool-call markup (note the space after the DSML token; V4 had none).
CALLS_START = f"\n\n<{DSML} calls"          # where a tool-call block begins in a completion
CALLS_OPEN = f"<{DSML} calls>"
CALLS_CLOSE = f"</{DSML} calls>"
INVOKE_OPEN = f"<{DSML} invoke"
INVOKE_CLOSE = f"</{DSML} invoke>"
PARAM_OPEN = f"<{DSML} parameter"
PARAM_CLOSE = f"</{DSML} parameter"            # followed by ">\n"

# Text that may never appear inside parsed reasoning or content.
FORBIDDEN_IN_OUTPUT = (BOS, EOS, THINK_START, THINK_END, DSML)
