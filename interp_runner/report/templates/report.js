"use strict";
// The report's only script (inline; the page's Content-Security-Policy admits it by its hash and nothing else):
// heatmap tooltips, copy buttons, and opening or closing every folded section. It fetches nothing.
(() => {
  const tip = document.getElementById("hm-tip");
  const shown = v => String(Number(v.toPrecision(4)));
  const signed = v => (v > 0 ? "+" : "") + shown(v);

  function describe(svg, cell) {
    const d = svg.dataset, cols = JSON.parse(d.cols), rows = JSON.parse(d.rows);
    const col = Number(cell.getAttribute("x") || 0), row = Number(cell.getAttribute("y") || 0);
    const text = d.values.split(",")[row * cols.length + col];
    const lines = [`${d.colName}: ${cols[col]}`, `${d.rowName}: ${rows[row]}`];
    if (text === "") {
      lines.push(`${d.valueName}: no value`);
    } else {
      lines.push(`${d.valueName}: ${shown(Number(text))}`);
      if (d.baselineName) lines.push(`${d.baselineName}: ${signed(Number(text) - Number(d.baseline))}`);
    }
    return lines.join("\n");
  }

  function place(event) {
    const gap = 14, box = tip.getBoundingClientRect();
    let x = event.clientX + gap, y = event.clientY + gap;
    if (x + box.width > window.innerWidth) x = Math.max(0, event.clientX - gap - box.width);
    if (y + box.height > window.innerHeight) y = Math.max(0, event.clientY - gap - box.height);
    tip.style.left = `${x}px`;
    tip.style.top = `${y}px`;
  }

  for (const svg of document.querySelectorAll("svg.heatmap")) {
    svg.addEventListener("mousemove", event => {
      const cell = event.target.closest(".hm-cells rect");
      if (!cell) {
        tip.hidden = true;
        return;
      }
      tip.textContent = describe(svg, cell);
      tip.hidden = false;
      place(event);
    });
    svg.addEventListener("mouseleave", () => { tip.hidden = true; });
  }

  for (const button of document.querySelectorAll("button[data-copy]")) {
    button.addEventListener("click", async () => {
      const source = document.getElementById(button.dataset.copy);
      let copied = false;
      try {
        await navigator.clipboard.writeText(source.textContent);
        copied = true;
      } catch (err) {  // no clipboard access (an older browser, or a denied permission): copy the selection
        const range = document.createRange();
        range.selectNodeContents(source);
        window.getSelection().removeAllRanges();
        window.getSelection().addRange(range);
        copied = document.execCommand("copy");
      }
      button.textContent = copied ? "Copied" : "Press Ctrl+C";
      setTimeout(() => { button.textContent = "Copy"; }, 2000);
    });
  }

  for (const button of document.querySelectorAll("button[data-fold]")) {
    button.addEventListener("click", () => {
      for (const details of document.querySelectorAll("details.fold")) details.open = button.dataset.fold === "open";
    });
  }
})();
