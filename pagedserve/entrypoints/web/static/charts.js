// Line charts on a canvas, with no library: drawChart(canvas, series, options) draws each series'
// values against time over the chart's span, with a zero-based y axis and a legend.
"use strict";

(function (global) {
  function niceMax(value) {
    if (!(value > 0)) return 1;
    const magnitude = Math.pow(10, Math.floor(Math.log10(value)));
    for (const step of [1, 2, 2.5, 5, 10]) if (value <= step * magnitude) return step * magnitude;
    return 10 * magnitude;
  }

  function drawChart(canvas, times, series, options) {
    const ratio = global.devicePixelRatio || 1;
    const width = canvas.clientWidth || 400;
    const height = canvas.clientHeight || 180;
    if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
    if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const left = 46, right = 8, top = 22, bottom = 18;
    const plotW = width - left - right, plotH = height - top - bottom;
    const span = options.span_s || 300;
    const end = times.length ? times[times.length - 1] : 0;
    let max = options.max || 0;
    if (!options.max) {
      for (const s of series) for (const v of s.values) if (v !== null && v > max) max = v;
      max = niceMax(max);
    }
    ctx.font = "11px system-ui, sans-serif";
    ctx.strokeStyle = "#dde2e8";
    ctx.fillStyle = "#5f6b7a";
    ctx.lineWidth = 1;
    for (let i = 0; i <= 4; i++) {
      const y = top + plotH - (plotH * i) / 4;
      ctx.beginPath();
      ctx.moveTo(left, y);
      ctx.lineTo(left + plotW, y);
      ctx.stroke();
      const label = (max * i) / 4;
      ctx.fillText(options.format ? options.format(label) : String(+label.toFixed(2)), 4, y + 4);
    }
    ctx.fillText("-" + Math.round(span / 60) + " min", left, height - 4);
    ctx.fillText("now", left + plotW - 20, height - 4);
    let legendX = left;
    for (const s of series) {
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 1.8;
      ctx.beginPath();
      let drawing = false;
      s.values.forEach((v, i) => {
        if (v === null || v === undefined) {
          drawing = false;
          return;
        }
        const x = left + plotW - ((end - times[i]) / span) * plotW;
        if (x < left) return;
        const y = top + plotH - (Math.min(v, max) / max) * plotH;
        if (drawing) ctx.lineTo(x, y);
        else ctx.moveTo(x, y);
        drawing = true;
      });
      ctx.stroke();
      ctx.fillStyle = s.color;
      ctx.fillRect(legendX, 6, 10, 10);
      ctx.fillStyle = "#1d2330";
      ctx.fillText(s.label, legendX + 14, 15);
      legendX += ctx.measureText(s.label).width + 34;
    }
  }

  global.drawChart = drawChart;
})(window);
