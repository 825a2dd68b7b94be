// A small Markdown renderer that builds DOM nodes (text only through text nodes, never innerHTML), so
// model output cannot inject HTML: fenced code, headings, lists, quotes, paragraphs; inline code,
// bold, italics and http(s) links.
"use strict";

(function (global) {
  const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\s][^*\n]*\*)|(_[^_\s][^_\n]*_)|\[([^\]\n]+)\]\(([^)\s]+)\)/g;

  function safeHref(url) {
    try {
      const parsed = new URL(url, "http://invalid.local/");
      return parsed.protocol === "http:" || parsed.protocol === "https:" ? parsed.href : null;
    } catch (err) {
      return null;
    }
  }

  function appendInline(parent, text) {
    let last = 0;
    const pattern = new RegExp(INLINE.source, "g"); // one per call: the recursion for bold / em has its own
    for (let match = pattern.exec(text); match !== null; match = pattern.exec(text)) {
      if (match.index > last) parent.appendChild(document.createTextNode(text.slice(last, match.index)));
      let node;
      if (match[1]) {
        node = document.createElement("code");
        node.textContent = match[1].slice(1, -1);
      } else if (match[2]) {
        node = document.createElement("strong");
        appendInline(node, match[2].slice(2, -2));
      } else if (match[3] || match[4]) {
        node = document.createElement("em");
        appendInline(node, (match[3] || match[4]).slice(1, -1));
      } else {
        const href = safeHref(match[6]);
        if (href === null) {
          node = document.createTextNode(match[0]);
        } else {
          node = document.createElement("a");
          node.href = href;
          node.rel = "noopener noreferrer nofollow";
          node.target = "_blank";
          node.textContent = match[5];
        }
      }
      parent.appendChild(node);
      last = pattern.lastIndex;
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
  }

  function appendLines(parent, lines) {
    lines.forEach((line, i) => {
      if (i > 0) parent.appendChild(document.createElement("br"));
      appendInline(parent, line);
    });
  }

  function render(text, container) {
    container.replaceChildren();
    const lines = text.replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      const fence = line.match(/^\s*(```|~~~)\s*([\w+-]*)\s*$/);
      if (fence) {
        const body = [];
        i += 1;
        while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
        i += 1; // the closing fence (or the end of an answer still streaming)
        const pre = document.createElement("pre");
        const code = document.createElement("code");
        if (fence[2]) code.dataset.language = fence[2];
        code.textContent = body.join("\n");
        pre.appendChild(code);
        container.appendChild(pre);
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      if (heading) {
        const node = document.createElement("h" + Math.min(heading[1].length + 2, 6));
        appendInline(node, heading[2]);
        container.appendChild(node);
        i += 1;
        continue;
      }
      const listKind = /^\s*[-*+]\s+/.test(line) ? "ul" : /^\s*\d+[.)]\s+/.test(line) ? "ol" : null;
      if (listKind) {
        const list = document.createElement(listKind);
        const itemPattern = listKind === "ul" ? /^\s*[-*+]\s+/ : /^\s*\d+[.)]\s+/;
        while (i < lines.length && itemPattern.test(lines[i])) {
          const item = document.createElement("li");
          appendInline(item, lines[i].replace(itemPattern, ""));
          list.appendChild(item);
          i += 1;
        }
        container.appendChild(list);
        continue;
      }
      if (/^\s*>/.test(line)) {
        const quote = document.createElement("blockquote");
        const body = [];
        while (i < lines.length && /^\s*>/.test(lines[i])) body.push(lines[i++].replace(/^\s*>\s?/, ""));
        appendLines(quote, body);
        container.appendChild(quote);
        continue;
      }
      if (line.trim() === "") {
        i += 1;
        continue;
      }
      const paragraph = document.createElement("p");
      const body = [];
      while (
        i < lines.length &&
        lines[i].trim() !== "" &&
        !/^\s*(```|~~~|#{1,6}\s|[-*+]\s|\d+[.)]\s|>)/.test(lines[i])
      ) {
        body.push(lines[i++]);
      }
      if (body.length === 0) body.push(lines[i++]); // a line no rule above took
      appendLines(paragraph, body);
      container.appendChild(paragraph);
    }
  }

  global.renderMarkdown = render;
})(window);
