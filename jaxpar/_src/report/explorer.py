"""The report's operator graph: every node, grouped by layer, source line or module path.

The nodes travel as compact JSON (strings interned) inside the page, and a small inline script
draws a group's rows only when it is opened, so a 24-layer model's ten thousand nodes cost about
half a megabyte and no time until looked at.  Rows are coloured by layout; a click on a row shows
the device grid of each of its layouts.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence

from jaxpar._src.plan import (
    LISTED_CATEGORIES,
    USER_ORIGINS,
    ShardingPlan,
    _comm_str,
    _seconds,
)
from jaxpar._src.report.context import OUTSIDE, NodeContext
from jaxpar._src.report.figures import LayoutTable

COLUMNS = ("id", "kind", "op", "loc", "layer", "module", "ins", "outs", "shapes", "origin",
           "comm", "bytes", "runner", "back", "heavy")


class _Strings:
    def __init__(self) -> None:
        self.table: list[str] = [""]
        self.index: dict[str, int] = {"": 0}

    def __call__(self, text: str) -> int:
        k = self.index.get(text)
        if k is None:
            k = self.index[text] = len(self.table)
            self.table.append(html.escape(text, quote=True))
        return k


def explorer_data(plan: ShardingPlan, contexts: Sequence[NodeContext], layouts: LayoutTable
                  ) -> str:
    """The JSON the explorer script reads (``</`` escaped for a ``<script>`` element)."""
    s = _Strings()
    searched = any(d.terms is not None for d in plan.decisions)
    shape_text: dict[tuple, int] = {}  # interned per distinct (in shapes, out shapes)
    module_text: dict[tuple[str, ...], int] = {}
    nodes = []
    for d, ctx, ins, outs in zip(plan.decisions, contexts, layouts.ins, layouts.outs,
                                 strict=True):
        kind = str(getattr(d.kind, "value", d.kind))
        if kind == "control":
            continue
        if kind in ("input", "output", "const"):
            op = d.label or f"{kind} {d.node}"
            loc = {"input": "arguments", "output": "results"}.get(kind, "constants")
        else:
            op, loc = d.name, ctx.location
        key = (d.in_shapes, d.out_shapes)
        shapes = shape_text.get(key)
        if shapes is None:
            a = " · ".join(_shape(x) for x in d.in_shapes)
            b = " · ".join(_shape(x) for x in d.out_shapes)
            shapes = shape_text[key] = s(f"{a} → {b}" if a and b else a or b)
        module = module_text.get(ctx.module)
        if module is None:
            module = module_text[ctx.module] = s(" › ".join(ctx.module))
        comm_bytes = d.comm_bytes if (d.collectives or d.redistributions) else 0.0
        comm = ""
        if comm_bytes > 0:
            comm = _comm_str(d) + (f" x{d.weight:g}" if d.weight != 1 else "")
        runner = d.runner_up_str() if searched and d.runner_up is not None else ""
        heavy = int(d.category in LISTED_CATEGORIES or d.origin in USER_ORIGINS or comm_bytes > 0)
        nodes.append([d.node, s(kind), s(op), s(loc), s(ctx.layer), module,
                      ins, outs,
                      shapes, s(d.origin), s(comm), round(comm_bytes), s(runner),
                      int(ctx.backward), heavy])
    data = {"s": s.table, "n": nodes, "searched": searched,
            "layers": any(c.layer not in ("", OUTSIDE) for c in contexts)}
    return json.dumps(data, separators=(",", ":")).replace("</", "<\\/")


def _shape(shape: Sequence[int]) -> str:
    return "×".join(map(str, shape)) if shape else "scalar"


def explorer_html(uid: str, data: str) -> str:
    """Controls, the (script-filled) tree, the data and the script.  The layouts (names,
    colours, device grids) are read from the page's ``.jxr-layouts`` section."""
    return (
        f'<div class="jxr-controls">group by <select class="jxr-mode">'
        f'<option value="layer">layer</option><option value="loc">source line</option>'
        f'<option value="module">module path</option><option value="op">operator</option>'
        f'</select> show <select class="jxr-filter"><option value="all">every node</option>'
        f'<option value="heavy">contractions, pins and communication</option>'
        f'<option value="comm">communicating nodes</option>'
        f'<option value="back">backward pass</option></select> '
        f'<input class="jxr-q" type="search" placeholder="filter: operator, file:line, layout">'
        f' <span class="jxr-count"></span></div>'
        f'<noscript>The operator graph needs JavaScript; every other section of this report is '
        f'plain HTML.</noscript><div class="jxr-tree"></div>'
        f'<script type="application/json" class="jxr-data">{data}</script>'
        f"<script>{_SCRIPT.replace('__UID__', uid).replace('__OUTSIDE__', OUTSIDE)}</script>")


def runner_up_rows(plan: ShardingPlan, contexts: Sequence[NodeContext], limit: int = 60
                   ) -> list[tuple[str, str, str, str, int, str]]:
    """Heavy searched operators with their runner-up, repeated layers folded together:
    ``(operator, location, chosen, runner-up, count, extra cost)``, closest calls first."""
    groups: dict[tuple[str, str, str, str], list[float]] = {}
    for d in plan.decisions:
        if d.runner_up is None or d.category not in LISTED_CATEGORIES:
            continue
        runner = d.runner_up_str().rsplit(" (+", 1)[0]
        key = (d.name, contexts[d.node].location, d.strategy_str(), runner)
        groups.setdefault(key, []).append(d.runner_up_extra_s)
    rows = []
    for (name, loc, chosen, runner), extras in sorted(groups.items(),
                                                      key=lambda kv: min(kv[1])):
        lo, hi = min(extras), max(extras)
        extra = _seconds(lo) if hi - lo <= 1e-3 * max(hi, 1e-30) else \
            f"{_seconds(lo)} – {_seconds(hi)}"
        rows.append((name, loc, chosen, runner, len(extras), "+" + extra))
    return rows[:limit]


_SCRIPT = r"""(function(){
var root=document.getElementById('__UID__');if(!root)return;
var D=JSON.parse(root.querySelector('script.jxr-data').textContent),S=D.s,N=D.n,
OUT='__OUTSIDE__';
var box=root.querySelector('.jxr-tree'),mode=root.querySelector('select.jxr-mode'),
filt=root.querySelector('select.jxr-filter'),q=root.querySelector('input.jxr-q'),
cnt=root.querySelector('.jxr-count');
function esc(t){return t.replace(/&/g,'&amp;').replace(/</g,'&lt;').replace(/>/g,'&gt;');}
var L=[].map.call(root.querySelectorAll('.jxr-layouts [data-l]'),function(e){
 return [esc(e.getAttribute('data-name')),e.getAttribute('data-color')];});
if(!D.layers){mode.querySelector('option[value=layer]').disabled=true;mode.value='loc';}
function chips(ix){return ix.map(function(i){return '<span class="chip" style="background:'+
 L[i][1]+'">'+L[i][0]+'</span>';}).join('');}
function text(n){return (S[n[2]]+' '+S[n[3]]+' '+S[n[8]]+' '+n[6].concat(n[7]).map(
 function(i){return L[i][0];}).join(' ')).toLowerCase();}
function keep(n){var f=filt.value,t=q.value.toLowerCase();
 if(f==='heavy'&&!n[14])return false;if(f==='comm'&&!n[11])return false;
 if(f==='back'&&!n[13])return false;return !t||text(n).indexOf(t)>=0;}
function row(n){var ru=D.searched?'<td>'+S[n[12]]+'</td>':'';
 return '<tr data-n="'+n[0]+'"><td>'+n[0]+'</td><td>'+(n[13]?'<i title="backward pass">∂</i> ':
 '')+S[n[2]]+'</td><td>'+S[n[3]]+'</td><td>'+chips(n[6])+(n[6].length?' → ':'')+chips(n[7])+
 '</td><td>'+S[n[8]]+'</td><td>'+(S[n[10]]||'-')+'</td><td>'+S[n[9]]+'</td>'+ru+'</tr>';}
function table(ns){return '<table class="jxr-nodes"><tr><th>#</th><th>operator</th>'+
 '<th>source</th><th>layouts (in → out)</th><th>shapes</th><th>comm/device (est.)</th>'+
 '<th>origin</th>'+(D.searched?'<th>runner-up (extra cost)</th>':'')+'</tr>'+
 ns.map(row).join('')+'</table>';}
function summary(name,ns){var c=0,b=0,seen={},top=[];ns.forEach(function(n){if(n[11]){c++;
 b+=n[11];}n[7].forEach(function(i){seen[i]=(seen[i]||0)+1;});});
 Object.keys(seen).sort(function(a,b){return seen[b]-seen[a];}).slice(0,4).forEach(
 function(i){top.push(+i);});
 return '<b>'+name+'</b> <span class="muted">'+ns.length+' nodes'+(c?', '+c+
 ' communicating ('+fmt(b)+' est.)':'')+'</span> '+chips(top);}
function fmt(b){var u=['B','KiB','MiB','GiB'],k=0;while(b>=1024&&k<3){b/=1024;k++;}
 return (k?b.toPrecision(3):b)+' '+u[k];}
var groups=[];
function group(ns,key){var m={},order=[];ns.forEach(function(n){var k=S[key(n)]||'(unknown)';
 if(!(k in m)){m[k]=[];order.push(k);}m[k].push(n);});
 var last=order.filter(function(k){return k===OUT;});
 return order.filter(function(k){return k!==OUT;}).concat(last).map(function(k){
 return {name:k,nodes:m[k],kids:[]};});}
function tree(ns){var top={kids:[],map:{},nodes:[]};ns.forEach(function(n){var p=S[n[5]]?
 S[n[5]].split(' › '):['(no module)'],t=top;p.forEach(function(part){if(!(part in t.map)){
 var c={name:part,kids:[],map:{},nodes:[],all:[]};t.map[part]=c;t.kids.push(c);}t=t.map[part];
 t.all.push(n);});t.nodes.push(n);});return top.kids;}
function draw(gs,depth){return gs.map(function(g){var i=groups.length;groups.push(g);
 return '<details data-g="'+i+'" style="margin-left:'+(depth*14)+'px"><summary>'+
 summary(g.name,g.all||g.nodes)+'</summary><div class="jxr-body"></div></details>';}).join('');}
function render(){var ns=N.filter(keep),m=mode.value;groups=[];cnt.textContent=ns.length+
 ' of '+N.length+' nodes';var gs=m==='module'?tree(ns):group(ns,function(n){return m===
 'layer'?n[4]:m==='op'?n[2]:n[3];});box.innerHTML=gs.length?draw(gs,0):
 '<p class="muted">no node matches</p>';}
box.addEventListener('toggle',function(e){var d=e.target;if(!d.open||d.dataset.done)return;
 d.dataset.done='1';var g=groups[+d.dataset.g],body=d.querySelector('.jxr-body');
 body.innerHTML=(g.nodes.length?table(g.nodes):'')+draw(g.kids,1);},true);
box.addEventListener('click',function(e){var tr=e.target.closest('tr[data-n]');if(!tr)return;
 var nx=tr.nextElementSibling;if(nx&&nx.classList.contains('jxr-grids')){nx.remove();return;}
 var n=N.filter(function(x){return x[0]===+tr.dataset.n;})[0],h='';
 n[6].concat(n[7]).forEach(function(i,k){var t=root.querySelector('.jxr-layouts [data-l="'+
 i+'"] svg');h+='<figure><figcaption>'+(k<n[6].length?'in '+k:'out '+(k-n[6].length))+
 ' '+L[i][0]+'</figcaption>'+(t?t.outerHTML:'')+'</figure>';});
 var r=document.createElement('tr');r.className='jxr-grids';r.innerHTML='<td colspan="9">'+h+
 '</td>';tr.after(r);});
[mode,filt].forEach(function(e){e.addEventListener('change',render);});
var timer;q.addEventListener('input',function(){clearTimeout(timer);timer=setTimeout(render,200);});
render();root.setAttribute('data-ready','1');
})();"""
