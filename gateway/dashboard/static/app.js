var j,$,he,Je,A,ue,me,ve,X,F,M,ye,Z,K,Y,Be,R={},J=[],je=/acit|ex(?:s|g|n|p|$)|rph|grid|ows|mnc|ntw|ine[ch]|zoo|^ord|itera/i,V=Array.isArray;function C(t,e){for(var n in e)t[n]=e[n];return t}function ee(t){t&&t.parentNode&&t.parentNode.removeChild(t)}function te(t,e,n){var o,s,_,a={};for(_ in e)_=="key"?o=e[_]:_=="ref"?s=e[_]:a[_]=e[_];if(arguments.length>2&&(a.children=arguments.length>3?j.call(arguments,2):n),typeof t=="function"&&t.defaultProps!=null)for(_ in t.defaultProps)a[_]===void 0&&(a[_]=t.defaultProps[_]);return W(t,a,o,s,null)}function W(t,e,n,o,s){var _={type:t,props:e,key:n,ref:o,__k:null,__:null,__b:0,__e:null,__c:null,constructor:void 0,__v:s??++he,__i:-1,__u:0};return s==null&&$.vnode!=null&&$.vnode(_),_}function z(t){return t.children}function I(t,e){this.props=t,this.context=e}function E(t,e){if(e==null)return t.__?E(t.__,t.__i+1):null;for(var n;e<t.__k.length;e++)if((n=t.__k[e])!=null&&n.__e!=null)return n.__e;return typeof t.type=="function"?E(t):null}function Ve(t){if(t.__P&&t.__d){var e=t.__v,n=e.__e,o=[],s=[],_=C({},e);_.__v=e.__v+1,$.vnode&&$.vnode(_),ne(t.__P,_,e,t.__n,t.__P.namespaceURI,32&e.__u?[n]:null,o,n??E(e),!!(32&e.__u),s),_.__v=e.__v,_.__.__k[_.__i]=_,we(o,_,s),e.__e=e.__=null,_.__e!=n&&ge(_)}}function ge(t){if((t=t.__)!=null&&t.__c!=null)return t.__e=t.__c.base=null,t.__k.some(function(e){if(e!=null&&e.__e!=null)return t.__e=t.__c.base=e.__e}),ge(t)}function de(t){(!t.__d&&(t.__d=!0)&&A.push(t)&&!B.__r++||ue!=$.debounceRendering)&&((ue=$.debounceRendering)||me)(B)}function B(){try{for(var t,e=1;A.length;)A.length>e&&A.sort(ve),t=A.shift(),e=A.length,Ve(t)}finally{A.length=B.__r=0}}function $e(t,e,n,o,s,_,a,l,u,i,c){var p,r,d,m,f,g,v=o&&o.__k||J,h=e.length;for(u=ze(n,e,v,u,h),p=0;p<h;p++)(d=n.__k[p])!=null&&(r=d.__i!=-1&&v[d.__i]||R,d.__i=p,g=ne(t,d,r,s,_,a,l,u,i,c),m=d.__e,d.ref&&r.ref!=d.ref&&(r.ref&&_e(r.ref,null,d),c.push(d.ref,d.__c||m,d)),f==null&&m!=null&&(f=m),4&d.__u?(u=be(d,u,t),r.__e&&(r.__e=null)):typeof d.type=="function"&&g!==void 0?u=g:m&&(u=m.nextSibling),d.__u&=-7);return n.__e=f,u}function ze(t,e,n,o,s){var _,a,l,u,i,c=n.length,p=c,r=0;for(t.__k=new Array(s),_=0;_<s;_++)(a=e[_])!=null&&typeof a!="boolean"&&typeof a!="function"?(typeof a=="string"||typeof a=="number"||typeof a=="bigint"||a.constructor==String?a=t.__k[_]=W(null,a,null,null,null):V(a)?a=t.__k[_]=W(z,{children:a},null,null,null):a.constructor===void 0&&a.__b>0?a=t.__k[_]=W(a.type,a.props,a.key,a.ref?a.ref:null,a.__v):t.__k[_]=a,u=_+r,a.__=t,a.__b=t.__b+1,l=null,(i=a.__i=Ge(a,n,u,p))!=-1&&(p--,(l=n[i])&&(l.__u|=2)),l==null||l.__v==null?(i==-1&&(s>c?r--:s<c&&r++),typeof a.type!="function"&&(a.__u|=4)):i!=u&&(i==u-1?r--:i==u+1?r++:(i>u?r--:r++,a.__u|=4))):t.__k[_]=null;if(p)for(_=0;_<c;_++)(l=n[_])!=null&&!(2&l.__u)&&(l.__e==o&&(o=E(l)),Se(l,l));return o}function be(t,e,n){var o,s;if(typeof t.type=="function"){for(o=t.__k,s=0;o&&s<o.length;s++)o[s]&&(o[s].__=t,e=be(o[s],e,n));return e}t.__e!=e&&(e&&t.type&&!e.parentNode&&(e=E(t)),e=n.insertBefore(t.__e,e||null));do e=e&&e.nextSibling;while(e!=null&&e.nodeType==8);return e}function Ge(t,e,n,o){var s,_,a,l=t.key,u=t.type,i=e[n],c=i!=null&&(2&i.__u)==0;if(i===null&&l==null||c&&l==i.key&&u==i.type)return n;if(o>(c?1:0)){for(s=n-1,_=n+1;s>=0||_<e.length;)if((i=e[a=s>=0?s--:_++])!=null&&!(2&i.__u)&&l==i.key&&u==i.type)return a}return-1}function pe(t,e,n){e[0]=="-"?t.setProperty(e,n??""):t[e]=n==null?"":typeof n!="number"||je.test(e)?n:n+"px"}function U(t,e,n,o,s){var _,a;e:if(e=="style")if(typeof n=="string")t.style.cssText=n;else{if(typeof o=="string"&&(t.style.cssText=o=""),o)for(e in o)n&&e in n||pe(t.style,e,"");if(n)for(e in n)o&&n[e]==o[e]||pe(t.style,e,n[e])}else if(e[0]=="o"&&e[1]=="n")_=e!=(e=e.replace(ye,"$1")),a=e.toLowerCase(),e=a in t||e=="onFocusOut"||e=="onFocusIn"?a.slice(2):e.slice(2),t.l||(t.l={}),t.l[e+_]=n,n?o?n[M]=o[M]:(n[M]=Z,t.addEventListener(e,_?Y:K,_)):t.removeEventListener(e,_?Y:K,_);else{if(s=="http://www.w3.org/2000/svg")e=e.replace(/xlink(H|:h)/,"h").replace(/sName$/,"s");else if(e!="width"&&e!="height"&&e!="href"&&e!="list"&&e!="form"&&e!="tabIndex"&&e!="download"&&e!="rowSpan"&&e!="colSpan"&&e!="role"&&e!="popover"&&e in t)try{t[e]=n??"";break e}catch{}typeof n=="function"||(n==null||n===!1&&e[4]!="-"?t.removeAttribute(e):t.setAttribute(e,e=="popover"&&n==1?"":n))}}function fe(t){return function(e){if(this.l){var n=this.l[e.type+t];if(e[F]==null)e[F]=Z++;else if(e[F]<n[M])return;return n($.event?$.event(e):e)}}}function ne(t,e,n,o,s,_,a,l,u,i){var c,p,r,d,m,f,g,v,h,x,P,N,q,ce,O,Q,S=e.type;if(e.constructor!==void 0)return null;128&n.__u&&(u=!!(32&n.__u),_=[l=e.__e=n.__e]),(c=$.__b)&&c(e);e:if(typeof S=="function"){p=a.length;try{if(h=e.props,x=S.prototype&&S.prototype.render,P=(c=S.contextType)&&o[c.__c],N=c?P?P.props.value:c.__:o,n.__c?v=(r=e.__c=n.__c).__=r.__E:(x?e.__c=r=new S(h,N):(e.__c=r=new I(h,N),r.constructor=S,r.render=Xe),P&&P.sub(r),r.state||(r.state={}),r.__n=o,d=r.__d=!0,r.__h=[],r._sb=[]),x&&r.__s==null&&(r.__s=r.state),x&&S.getDerivedStateFromProps!=null&&(r.__s==r.state&&(r.__s=C({},r.__s)),C(r.__s,S.getDerivedStateFromProps(h,r.__s))),m=r.props,f=r.state,r.__v=e,d)x&&S.getDerivedStateFromProps==null&&r.componentWillMount!=null&&r.componentWillMount(),x&&r.componentDidMount!=null&&r.__h.push(r.componentDidMount);else{if(x&&S.getDerivedStateFromProps==null&&h!==m&&r.componentWillReceiveProps!=null&&r.componentWillReceiveProps(h,N),e.__v==n.__v||!r.__e&&r.shouldComponentUpdate!=null&&r.shouldComponentUpdate(h,r.__s,N)===!1){e.__v!=n.__v&&(r.props=h,r.state=r.__s,r.__d=!1),e.__e=n.__e,e.__k=n.__k,e.__k.some(function(T){T&&(T.__=e)}),J.push.apply(r.__h,r._sb),r._sb=[],r.__h.length&&a.push(r),l=E(n);break e}r.componentWillUpdate!=null&&r.componentWillUpdate(h,r.__s,N),x&&r.componentDidUpdate!=null&&r.__h.push(function(){r.componentDidUpdate(m,f,g)})}if(r.context=N,r.props=h,r.__P=t,r.__e=!1,q=$.__r,ce=0,x)r.state=r.__s,r.__d=!1,q&&q(e),c=r.render(r.props,r.state,r.context),J.push.apply(r.__h,r._sb),r._sb=[];else do r.__d=!1,q&&q(e),c=r.render(r.props,r.state,r.context),r.state=r.__s;while(r.__d&&++ce<25);r.state=r.__s,r.getChildContext!=null&&(o=C(C({},o),r.getChildContext())),x&&!d&&r.getSnapshotBeforeUpdate!=null&&(g=r.getSnapshotBeforeUpdate(m,f)),O=c!=null&&c.type===z&&c.key==null?xe(c.props.children):c,l=$e(t,V(O)?O:[O],e,n,o,s,_,a,l,u,i),r.base=e.__e,e.__u&=-161,r.__h.length&&a.push(r),v&&(r.__E=r.__=null)}catch(T){if(a.length=p,e.__v=null,u||_!=null){if(T.then){for(e.__u|=u?160:128;l&&l.nodeType==8&&l.nextSibling;)l=l.nextSibling;_!=null&&(_[_.indexOf(l)]=null),e.__e=l}else if(_!=null)for(Q=_.length;Q--;)ee(_[Q])}else e.__e=n.__e;e.__k==null&&(e.__k=n.__k||[]),T.then||ke(e),$.__e(T,e,n)}}else _==null&&e.__v==n.__v?(e.__k=n.__k,e.__e=n.__e):l=e.__e=Qe(n.__e,e,n,o,s,_,a,u,i);return(c=$.diffed)&&c(e),128&e.__u?void 0:l}function ke(t){t&&(t.__c&&(t.__c.__e=!0),t.__k&&t.__k.some(ke))}function we(t,e,n){for(var o=0;o<n.length;o++)_e(n[o],n[++o],n[++o]);$.__c&&$.__c(e,t),t.some(function(s){try{t=s.__h,s.__h=[],t.some(function(_){_.call(s)})}catch(_){$.__e(_,s.__v)}})}function xe(t){return typeof t!="object"||t==null||t.__b>0?t:V(t)?t.map(xe):t.constructor!==void 0?null:C({},t)}function Qe(t,e,n,o,s,_,a,l,u){var i,c,p,r,d,m,f,g=n.props||R,v=e.props,h=e.type;if(h=="svg"?s="http://www.w3.org/2000/svg":h=="math"?s="http://www.w3.org/1998/Math/MathML":s||(s="http://www.w3.org/1999/xhtml"),_!=null){for(i=0;i<_.length;i++)if((d=_[i])&&"setAttribute"in d==!!h&&(h?d.localName==h:d.nodeType==3)){t=d,_[i]=null;break}}if(t==null){if(h==null)return document.createTextNode(v);t=document.createElementNS(s,h,v.is&&v),l&&($.__m&&$.__m(e,_),l=!1),_=null}if(h==null)g===v||l&&t.data==v||(t.data=v);else{if(_=h=="textarea"&&v.defaultValue!=null?null:_&&j.call(t.childNodes),!l&&_!=null)for(g={},i=0;i<t.attributes.length;i++)g[(d=t.attributes[i]).name]=d.value;for(i in g)d=g[i],i=="dangerouslySetInnerHTML"?p=d:i=="children"||i in v||i=="value"&&"defaultValue"in v||i=="checked"&&"defaultChecked"in v||U(t,i,null,d,s);for(i in v)d=v[i],i=="children"?r=d:i=="dangerouslySetInnerHTML"?c=d:i=="value"?m=d:i=="checked"?f=d:l&&typeof d!="function"||g[i]===d||U(t,i,d,g[i],s);if(c)l||p&&(c.__html==p.__html||c.__html==t.innerHTML)||(t.innerHTML=c.__html),e.__k=[];else if(p&&(t.innerHTML=""),$e(e.type=="template"?t.content:t,V(r)?r:[r],e,n,o,h=="foreignObject"?"http://www.w3.org/1999/xhtml":s,_,a,_?_[0]:n.__k&&E(n,0),l,u),_!=null)for(i=_.length;i--;)ee(_[i]);l&&h!="textarea"||(i="value",h=="progress"&&m==null?t.removeAttribute("value"):m!=null&&(m!==t[i]||h=="progress"&&!m||h=="option"&&m!=g[i])&&U(t,i,m,g[i],s),i="checked",f!=null&&f!=t[i]&&U(t,i,f,g[i],s))}return t}function _e(t,e,n){try{if(typeof t=="function"){var o=typeof t.__u=="function";o&&t.__u(),o&&e==null||(t.__u=t(e))}else t.current=e}catch(s){$.__e(s,n)}}function Se(t,e,n){var o,s;if($.unmount&&$.unmount(t),(o=t.ref)&&(o.current&&o.current!=t.__e||_e(o,null,e)),(o=t.__c)!=null){if(o.componentWillUnmount)try{o.componentWillUnmount()}catch(_){$.__e(_,e)}o.base=o.__P=o.__n=null}if(o=t.__k)for(s=0;s<o.length;s++)o[s]&&Se(o[s],e,n||typeof t.type!="function");n||ee(t.__e),t.__c=t.__=t.__e=void 0}function Xe(t,e,n){return this.constructor(t,n)}function Ce(t,e,n){var o,s,_,a;e==document&&(e=document.documentElement),$.__&&$.__(t,e),s=(o=typeof n=="function")?null:n&&n.__k||e.__k,_=[],a=[],ne(e,t=(!o&&n||e).__k=te(z,null,[t]),s||R,R,e.namespaceURI,!o&&n?[n]:s?null:e.firstChild?j.call(e.childNodes):null,_,!o&&n?n:s?s.__e:e.firstChild,o,a),we(_,t,a),t.props.children=null}j=J.slice,$={__e:function(t,e,n,o){for(var s,_,a;e=e.__;)if((s=e.__c)&&!s.__)try{if((_=s.constructor)&&_.getDerivedStateFromError!=null&&(s.setState(_.getDerivedStateFromError(t)),a=s.__d),s.componentDidCatch!=null&&(s.componentDidCatch(t,o||{}),a=s.__d),a)return s.__E=s}catch(l){t=l}throw t}},he=0,Je=function(t){return t!=null&&t.constructor===void 0},I.prototype.setState=function(t,e){var n;n=this.__s!=null&&this.__s!=this.state?this.__s:this.__s=C({},this.state),typeof t=="function"&&(t=t(C({},n),this.props)),t&&C(n,t),t!=null&&this.__v&&(e&&this._sb.push(e),de(this))},I.prototype.forceUpdate=function(t){this.__v&&(this.__e=!0,t&&this.__h.push(t),de(this))},I.prototype.render=z,A=[],me=typeof Promise=="function"?Promise.prototype.then.bind(Promise.resolve()):setTimeout,ve=function(t,e){return t.__v.__b-e.__v.__b},B.__r=0,X=Math.random().toString(8),F="__d"+X,M="__a"+X,ye=/(PointerCapture)$|Capture$/i,Z=0,K=fe(!1),Y=fe(!0),Be=0;var D,b,oe,Ae,re=0,De=[],k=$,Pe=k.__b,Ne=k.__r,Ee=k.diffed,Te=k.__c,He=k.unmount,qe=k.__;function ae(t,e){k.__h&&k.__h(b,t,re||e),re=0;var n=b.__H||(b.__H={__:[],__h:[]});return t>=n.__.length&&n.__.push({}),n.__[t]}function w(t){return re=1,Ke(Ue,t)}function Ke(t,e,n){var o=ae(D++,2);if(o.t=t,!o.__c&&(o.__=[n?n(e):Ue(void 0,e),function(l){var u=o.__N?o.__N[0]:o.__[0],i=o.t(u,l);u!==i&&(o.__N=[i,o.__[1]],o.__c.setState({}))}],o.__c=b,!b.__f)){var s=function(l,u,i){if(!o.__c.__H)return!0;var c=!1,p=o.__c.props!==l;if(o.__c.__H.__.some(function(d){if(d.__N){c=!0;var m=d.__[0];d.__=d.__N,d.__N=void 0,m!==d.__[0]&&(p=!0)}}),_){var r=_.call(this,l,u,i);return c?r||p:r}return!c||p};b.__f=!0;var _=b.shouldComponentUpdate,a=b.componentWillUpdate;b.componentWillUpdate=function(l,u,i){if(this.__e){var c=_;_=void 0,s(l,u,i),_=c}a&&a.call(this,l,u,i)},b.shouldComponentUpdate=s}return o.__N||o.__}function L(t,e){var n=ae(D++,3);!k.__s&&Oe(n.__H,e)&&(n.__=t,n.u=e,b.__H.__h.push(n))}function Le(t,e){var n=ae(D++,7);return Oe(n.__H,e)&&(n.__=t(),n.__H=e,n.__h=t),n.__}function Ye(){for(var t;t=De.shift();){var e=t.__H;if(t.__P&&e)try{e.__h.some(G),e.__h.some(se),e.__h=[]}catch(n){e.__h=[],k.__e(n,t.__v)}}}k.__b=function(t){b=null,Pe&&Pe(t)},k.__=function(t,e){t&&e.__k&&e.__k.__m&&(t.__m=e.__k.__m),qe&&qe(t,e)},k.__r=function(t){Ne&&Ne(t),D=0;var e=(b=t.__c).__H;e&&(oe===b?(e.__h=[],b.__h=[],e.__.some(function(n){n.__N&&(n.__=n.__N),n.u=n.__N=void 0})):(e.__h.some(G),e.__h.some(se),e.__h=[],D=0)),oe=b},k.diffed=function(t){Ee&&Ee(t);var e=t.__c;e&&e.__H&&(e.__H.__h.length&&(De.push(e)!==1&&Ae===k.requestAnimationFrame||((Ae=k.requestAnimationFrame)||Ze)(Ye)),e.__H.__.some(function(n){n.u&&(n.__H=n.u,n.u=void 0)})),oe=b=null},k.__c=function(t,e){e.some(function(n){try{n.__h.some(G),n.__h=n.__h.filter(function(o){return!o.__||se(o)})}catch(o){e.some(function(s){s.__h&&(s.__h=[])}),e=[],k.__e(o,n.__v)}}),Te&&Te(t,e)},k.unmount=function(t){He&&He(t);var e,n=t.__c;n&&n.__H&&(n.__H.__.some(function(o){try{G(o)}catch(s){e=s}}),n.__H=void 0,e&&k.__e(e,n.__v))};var Me=typeof requestAnimationFrame=="function";function Ze(t){var e,n=function(){clearTimeout(o),Me&&cancelAnimationFrame(e),setTimeout(t)},o=setTimeout(n,35);Me&&(e=requestAnimationFrame(n))}function G(t){var e=b,n=t.__c;typeof n=="function"&&(t.__c=void 0,n()),b=e}function se(t){var e=b;t.__c=t.__(),b=e}function Oe(t,e){return!t||t.length!==e.length||e.some(function(n,o){return n!==t[o]})}function Ue(t,e){return typeof e=="function"?e(t):e}var We=function(t,e,n,o){var s;e[0]=0;for(var _=1;_<e.length;_++){var a=e[_++],l=e[_]?(e[0]|=a?1:2,n[e[_++]]):e[++_];a===3?o[0]=l:a===4?o[1]=Object.assign(o[1]||{},l):a===5?(o[1]=o[1]||{})[e[++_]]=l:a===6?o[1][e[++_]]+=l+"":a?(s=t.apply(l,We(t,l,n,["",null])),o.push(s),l[0]?e[0]|=2:(e[_-2]=0,e[_]=s)):o.push(l)}return o},Fe=new Map;function Ie(t){var e=Fe.get(this);return e||(e=new Map,Fe.set(this,e)),(e=We(this,e.get(t)||(e.set(t,e=function(n){for(var o,s,_=1,a="",l="",u=[0],i=function(r){_===1&&(r||(a=a.replace(/^\s*\n\s*|\s*\n\s*$/g,"")))?u.push(0,r,a):_===3&&(r||a)?(u.push(3,r,a),_=2):_===2&&a==="..."&&r?u.push(4,r,0):_===2&&a&&!r?u.push(5,0,!0,a):_>=5&&((a||!r&&_===5)&&(u.push(_,0,a,s),_=6),r&&(u.push(_,r,0,s),_=6)),a=""},c=0;c<n.length;c++){c&&(_===1&&i(),i(c));for(var p=0;p<n[c].length;p++)o=n[c][p],_===1?o==="<"?(i(),u=[u],_=3):a+=o:_===4?a==="--"&&o===">"?(_=1,a=""):a=o+a[0]:l?o===l?l="":a+=o:o==='"'||o==="'"?l=o:o===">"?(i(),_=1):_&&(o==="="?(_=5,s=a,a=""):o==="/"&&(_<5||n[c][p+1]===">")?(i(),_===3&&(u=u[0]),_=u,(u=u[0]).push(2,0,_),_=0):o===" "||o==="	"||o===`
`||o==="\r"?(i(),_=2):a+=o),_===3&&a==="!--"&&(_=4,u=u[0])}return i(),u}(t)),e),arguments,[])).length>1?e:e[0]}var y=Ie.bind(te),Re={group_chat:{agent_ids:["IndustryExpertAgent","TechnicalAnalysisAgent","FundamentalAnalysisAgent"],query:"What stock should I buy?",option_label:"stocks"},handoff_workflow:{task:"Process refund for order #12345",steps:[{agent_id:"CustomerAgent"},{agent_id:"SellerAgent"},{agent_id:"PaymentAgent"},{agent_id:"NotificationAgent"}],context:{order_id:"12345"},failure_agent:"NotificationAgent"},collaborative_filtering:{agent_ids:["PriceAgent","QualityAgent","LocationAgent","ReviewsAgent"],weights:{price:.2,quality:.4,location:.3,reviews:.1},query:"Hotel in Paris near Eiffel Tower"},consensus:{problem:"Should we migrate to microservices?",wait_for_all_votes:!0},research:{query:"What is the latest lithium-ion battery recycling rate?"},route:{request_type:"stock_recommendation",query:"What stock should I buy?"},parallel:{patterns:[{name:"stocks",route:{request_type:"stock_recommendation",query:"Best stock?"}},{name:"hotels",route:{request_type:"hotel_recommendation",query:"Hotel in Paris"}}]}};async function le(t){let e=await fetch(t);if(!e.ok)throw new Error(`${e.status} ${await e.text()}`);return e.json()}function H(t,e=2){return typeof t=="number"?t.toFixed(e):"\u2013"}function ie({title:t,points:e,series:n,unit:o}){let l=e.flatMap(p=>n.map(r=>p[r.key]||0)),u=Math.max(1e-9,...l)*1.1,i=p=>e.map((r,d)=>{let m=28+d/Math.max(1,e.length-1)*426,f=140-28/2-(r[p]||0)/u*112;return`${d?"L":"M"}${m.toFixed(1)},${f.toFixed(1)}`}).join(" "),c=e[e.length-1]||{};return y`<figure class="chart" data-chart=${t}>
    <figcaption>
      ${t}
      ${n.map(p=>y`<span class="legend" style=${`color:${p.color}`}
          >${p.label} ${H(c[p.key])} ${o}</span
        >`)}
    </figcaption>
    <svg viewBox=${"0 0 460 140"} role="img" aria-label=${t}>
      <text x="2" y="12" class="axis">${H(u,1)}</text>
      <text x="2" y=${136} class="axis">0</text>
      ${n.map(p=>y`<path d=${i(p.key)} fill="none" stroke=${p.color} stroke-width="1.8" />`)}
    </svg>
  </figure>`}function et({agents:t}){return y`<section>
    <h2>Agents <small>${t.length}</small></h2>
    <table id="agents">
      <thead>
        <tr>
          <th>agent</th><th>types</th><th>health</th><th>HIGH</th><th>MEDIUM</th><th>LOW</th>
          <th>in flight</th><th>dead</th><th>address</th>
        </tr>
      </thead>
      <tbody>
        ${t.map(e=>y`<tr data-agent=${e.agent_id}>
            <td class="id">${e.agent_id}</td>
            <td>${e.agent_types.join(", ")}</td>
            <td class=${`health ${e.health}`}>${e.health}</td>
            <td>${e.high}</td><td>${e.medium}</td><td>${e.low}</td>
            <td>${e.in_flight}</td><td>${e.dead_letters}</td>
            <td class="addr">${e.address}</td>
          </tr>`)}
      </tbody>
    </table>
  </section>`}function tt({trace:t}){if(!t)return null;if(!t.spans.length)return y`<p class="note">${t.note||"no spans"}</p>`;let e=new Set(t.critical_path),n=Math.max(t.total_ms,1e-6);return y`<div class="waterfall" id="waterfall">
    <p>${t.spans.length} spans, ${H(t.total_ms)} ms; critical path highlighted</p>
    ${t.spans.map(o=>y`<div class=${`span ${e.has(o.span_id)?"critical":""}`}
        data-span=${o.span_id}>
        <span class="label" title=${o.service}>${o.name}</span>
        <span class="track">
          <span
            class="bar"
            style=${`left:${o.offset_ms/n*100}%;width:${Math.max(.4,o.duration_ms/n*100)}%`}
          ></span>
        </span>
        <span class="ms">${H(o.duration_ms)} ms</span>
      </div>`)}
  </div>`}function nt(t,e){let n=H(e.accuracy*100,0);return`${t} accuracy ${n}% (${e.satisfied} of ${e.rated} rated runs)`}function _t({run:t,state:e}){let[n,o]=w(""),[s,_]=w(null);if(L(()=>_(null),[t.run_id]),!e.allow_runs||!["COMPLETED","PARTIAL"].includes(t.status))return null;let a=async l=>{let u={"Content-Type":"application/json"};n&&(u.Authorization=`Bearer ${n}`);let i=await fetch(`/api/runs/${t.run_id}/feedback`,{method:"POST",headers:u,body:JSON.stringify({satisfied:l})}),c=await i.text();try{let p=JSON.parse(c);_(i.ok?{ok:!0,...p}:{ok:!1,message:p.message||c})}catch{_({ok:!1,message:c})}};return y`<p id="feedback">
    Did this outcome satisfy you?
    ${e.credential_required&&y`<input
      id="feedback-token"
      type="password"
      placeholder="gateway credential"
      value=${n}
      onInput=${l=>o(l.target.value)}
    />`}
    <button id="satisfied" onClick=${()=>a(!0)}>Yes</button>
    <button id="not-satisfied" onClick=${()=>a(!1)}>No</button>
    ${s&&(s.ok?y`<span id="accuracy">${nt(t.pattern,s)}</span>`:y`<span class="error" id="feedback-error">${s.message}</span>`)}
  </p>`}function ot({run:t,events:e,state:n}){let[o,s]=w(null);return L(()=>s(null),[t.run_id]),y`<section id="run-detail" data-run=${t.run_id}>
    <h2>
      ${t.pattern} <code>${t.run_id}</code>
      <span class=${`status ${t.status}`}>${t.status}</span>
      <button
        id="show-trace"
        onClick=${async()=>s(await le(`/api/traces/${t.run_id}`))}
      >
        Trace waterfall
      </button>
    </h2>
    <ol class="events">
      ${e.map(_=>y`<li class=${`event ${_.kind}`} data-kind=${_.kind}>
          <span class="kind">${_.kind}</span>
          ${_.agent_id&&y`<span class="agent">${_.agent_id}</span>`}
          <span class="summary">${_.summary}</span>
          <span class="ms">${H(_.elapsed_ms,1)} ms</span>
        </li>`)}
    </ol>
    <${_t} run=${t} state=${n} />
    <${tt} trace=${o} />
  </section>`}function rt({state:t,onStarted:e}){let[n,o]=w("group_chat"),[s,_]=w(JSON.stringify(Re.group_chat,null,2)),[a,l]=w(""),[u,i]=w("");if(!t.allow_runs)return y`<section><p class="note">Read-only dashboard.</p></section>`;let c=r=>{o(r),_(JSON.stringify(Re[r]||{},null,2))};return y`<section>
    <h2>Start a pattern</h2>
    <form id="start" onSubmit=${async r=>{r.preventDefault(),i("");let d;try{d=JSON.parse(s)}catch(v){i(`not JSON: ${v.message}`);return}let m={"Content-Type":"application/json"};a&&(m.Authorization=`Bearer ${a}`);let f=await fetch(`/api/patterns/${n}`,{method:"POST",headers:m,body:JSON.stringify(d)}),g=await f.text();if(!f.ok){try{i(JSON.parse(g).message||g)}catch{i(g)}return}e(JSON.parse(g).run_id)}}>
      <select id="pattern" value=${n} onChange=${r=>c(r.target.value)}>
        ${t.patterns.map(r=>y`<option value=${r}>${r}</option>`)}
      </select>
      ${t.credential_required&&y`<input
        id="token"
        type="password"
        placeholder="gateway credential"
        value=${a}
        onInput=${r=>l(r.target.value)}
      />`}
      <textarea id="body" rows="8" value=${s} onInput=${r=>_(r.target.value)} />
      <button id="run" type="submit">Start</button>
      ${u&&y`<p class="error" id="start-error">${u}</p>`}
    </form>
  </section>`}function st({state:t}){let[e,n]=w(null),[o,s]=w(""),[_,a]=w(null),l=async()=>n(await le("/api/dead-letters"));L(()=>{l()},[]);let u=async c=>{let p={"Content-Type":"application/json"};o&&(p.Authorization=`Bearer ${o}`);let r=await fetch("/api/dead-letters/requeue",{method:"POST",headers:p,body:JSON.stringify({agent_id:c.to_agent,message_ids:[c.message_id]})}),d=await r.text();try{let m=JSON.parse(d);a(r.ok?{ok:!0,...m}:{ok:!1,message:m.message||d})}catch{a({ok:!1,message:d})}await l()},i=t.allow_runs;return y`<section>
    <h2>Dead letters <button onClick=${l}>Refresh</button></h2>
    ${i&&t.credential_required&&y`<input
      id="requeue-token"
      type="password"
      placeholder="gateway credential"
      value=${o}
      onInput=${c=>s(c.target.value)}
    />`}
    ${_&&(_.ok?y`<p id="requeue-result">
          ${_.requeued} requeued${_.left?`, ${_.left} left (queue full)`:""}
        </p>`:y`<p class="error" id="requeue-result">${_.message}</p>`)}
    ${e&&(e.length?y`<table id="dead-letters">
          <thead>
            <tr>
              <th>message</th><th>from</th><th>to</th><th>reason</th><th>at</th>
              ${i&&y`<th></th>`}
            </tr>
          </thead>
          <tbody>
            ${e.map(c=>y`<tr>
                <td><code>${c.message_id}</code></td><td>${c.from_agent}</td>
                <td>${c.to_agent}</td><td>${c.reason}</td><td>${c.dead_lettered_at}</td>
                ${i&&y`<td>
                  <button class="requeue" data-message=${c.message_id} onClick=${()=>u(c)}>
                    Requeue
                  </button>
                </td>`}
              </tr>`)}
          </tbody>
        </table>`:y`<p class="note" id="dead-letters">none</p>`)}
  </section>`}function at(){let[t,e]=w(null),[n,o]=w([]),[s,_]=w([]),[a,l]=w(null),[u,i]=w({}),[c,p]=w(!1);L(()=>{let f=new EventSource("/api/events");return f.addEventListener("open",()=>p(!0)),f.addEventListener("error",()=>p(!1)),f.addEventListener("state",g=>{let v=JSON.parse(g.data);e(v),o(v.history),_(v.runs)}),f.addEventListener("snapshot",g=>{let v=JSON.parse(g.data);e(h=>({...h,...v})),o(h=>[...h.slice(-299),v.point])}),f.addEventListener("event",g=>{let{run:v,event:h}=JSON.parse(g.data);_(x=>[v,...x.filter(P=>P.run_id!==v.run_id)].slice(0,50)),i(x=>({...x,[v.run_id]:[...x[v.run_id]||[],h]}))}),()=>f.close()},[]);let r=async f=>{l(f);try{let g=await le(`/api/runs/${f}`);i(v=>{let h=v[f]||[];return{...v,[f]:g.events.length>=h.length?g.events:h}})}catch{}},d=Le(()=>s.find(f=>f.run_id===a),[s,a]);if(!t)return y`<p class="note">connecting…</p>`;let m=t.totals||{};return y`<main>
    <header>
      <h1>agentmesh</h1>
      <span id="live" class=${c?"live":"offline"}>${c?"live":"offline"}</span>
      <span>held <b>${m.held}</b></span>
      <span>sent <b>${m.sent_count}</b></span>
      <span>delivered <b>${m.delivered_count}</b></span>
      <span>expired <b>${m.expired_count}</b></span>
      <span>dead <b>${m.dead_lettered_count}</b></span>
    </header>
    <div class="charts">
      <${ie}
        title="Messages per second"
        points=${n}
        unit="/s"
        series=${[{key:"sent_per_s",label:"sent",color:"#2563eb"},{key:"delivered_per_s",label:"delivered",color:"#16a34a"}]}
      />
      <${ie}
        title="Send latency"
        points=${n}
        unit="ms"
        series=${[{key:"send_p50_ms",label:"p50",color:"#2563eb"},{key:"send_p95_ms",label:"p95",color:"#d97706"},{key:"send_p99_ms",label:"p99",color:"#dc2626"}]}
      />
      <${ie}
        title="Request/response latency"
        points=${n}
        unit="ms"
        series=${[{key:"roundtrip_p50_ms",label:"p50",color:"#2563eb"},{key:"roundtrip_p95_ms",label:"p95",color:"#d97706"},{key:"roundtrip_p99_ms",label:"p99",color:"#dc2626"}]}
      />
    </div>
    <${et} agents=${t.agents||[]} />
    <div class="columns">
      <section>
        <h2>Pattern runs</h2>
        <ul id="runs">
          ${s.map(f=>y`<li
              class=${`run ${f.run_id===a?"selected":""}`}
              data-run=${f.run_id}
              onClick=${()=>r(f.run_id)}
            >
              <span class="pattern">${f.pattern}</span> <code>${f.run_id}</code>
              <span class=${`status ${f.status}`}>${f.status}</span>
            </li>`)}
        </ul>
      </section>
      <${rt} state=${t} onStarted=${r} />
    </div>
    ${d&&y`<${ot} run=${d} events=${u[d.run_id]||[]} state=${t} />`}
    <${st} state=${t} />
  </main>`}Ce(y`<${at} />`,document.getElementById("app"));
