var j,$,ht,Jt,P,ut,mt,vt,X,q,D,yt,Z,K,Y,Bt,R={},J=[],jt=/acit|ex(?:s|g|n|p|$)|rph|grid|ows|mnc|ntw|ine[ch]|zoo|^ord|itera/i,V=Array.isArray;function C(e,t){for(var n in t)e[n]=t[n];return e}function tt(e){e&&e.parentNode&&e.parentNode.removeChild(e)}function et(e,t,n){var o,s,_,a={};for(_ in t)_=="key"?o=t[_]:_=="ref"?s=t[_]:a[_]=t[_];if(arguments.length>2&&(a.children=arguments.length>3?j.call(arguments,2):n),typeof e=="function"&&e.defaultProps!=null)for(_ in e.defaultProps)a[_]===void 0&&(a[_]=e.defaultProps[_]);return W(e,a,o,s,null)}function W(e,t,n,o,s){var _={type:e,props:t,key:n,ref:o,__k:null,__:null,__b:0,__e:null,__c:null,constructor:void 0,__v:s??++ht,__i:-1,__u:0};return s==null&&$.vnode!=null&&$.vnode(_),_}function z(e){return e.children}function I(e,t){this.props=e,this.context=t}function E(e,t){if(t==null)return e.__?E(e.__,e.__i+1):null;for(var n;t<e.__k.length;t++)if((n=e.__k[t])!=null&&n.__e!=null)return n.__e;return typeof e.type=="function"?E(e):null}function Vt(e){if(e.__P&&e.__d){var t=e.__v,n=t.__e,o=[],s=[],_=C({},t);_.__v=t.__v+1,$.vnode&&$.vnode(_),nt(e.__P,_,t,e.__n,e.__P.namespaceURI,32&t.__u?[n]:null,o,n??E(t),!!(32&t.__u),s),_.__v=t.__v,_.__.__k[_.__i]=_,wt(o,_,s),t.__e=t.__=null,_.__e!=n&&gt(_)}}function gt(e){if((e=e.__)!=null&&e.__c!=null)return e.__e=e.__c.base=null,e.__k.some(function(t){if(t!=null&&t.__e!=null)return e.__e=e.__c.base=t.__e}),gt(e)}function dt(e){(!e.__d&&(e.__d=!0)&&P.push(e)&&!B.__r++||ut!=$.debounceRendering)&&((ut=$.debounceRendering)||mt)(B)}function B(){try{for(var e,t=1;P.length;)P.length>t&&P.sort(vt),e=P.shift(),t=P.length,Vt(e)}finally{P.length=B.__r=0}}function $t(e,t,n,o,s,_,a,l,c,i,u){var p,r,d,v,f,y,m=o&&o.__k||J,h=t.length;for(c=zt(n,t,m,c,h),p=0;p<h;p++)(d=n.__k[p])!=null&&(r=d.__i!=-1&&m[d.__i]||R,d.__i=p,y=nt(e,d,r,s,_,a,l,c,i,u),v=d.__e,d.ref&&r.ref!=d.ref&&(r.ref&&_t(r.ref,null,d),u.push(d.ref,d.__c||v,d)),f==null&&v!=null&&(f=v),4&d.__u?(c=bt(d,c,e),r.__e&&(r.__e=null)):typeof d.type=="function"&&y!==void 0?c=y:v&&(c=v.nextSibling),d.__u&=-7);return n.__e=f,c}function zt(e,t,n,o,s){var _,a,l,c,i,u=n.length,p=u,r=0;for(e.__k=new Array(s),_=0;_<s;_++)(a=t[_])!=null&&typeof a!="boolean"&&typeof a!="function"?(typeof a=="string"||typeof a=="number"||typeof a=="bigint"||a.constructor==String?a=e.__k[_]=W(null,a,null,null,null):V(a)?a=e.__k[_]=W(z,{children:a},null,null,null):a.constructor===void 0&&a.__b>0?a=e.__k[_]=W(a.type,a.props,a.key,a.ref?a.ref:null,a.__v):e.__k[_]=a,c=_+r,a.__=e,a.__b=e.__b+1,l=null,(i=a.__i=Gt(a,n,c,p))!=-1&&(p--,(l=n[i])&&(l.__u|=2)),l==null||l.__v==null?(i==-1&&(s>u?r--:s<u&&r++),typeof a.type!="function"&&(a.__u|=4)):i!=c&&(i==c-1?r--:i==c+1?r++:(i>c?r--:r++,a.__u|=4))):e.__k[_]=null;if(p)for(_=0;_<u;_++)(l=n[_])!=null&&!(2&l.__u)&&(l.__e==o&&(o=E(l)),St(l,l));return o}function bt(e,t,n){var o,s;if(typeof e.type=="function"){for(o=e.__k,s=0;o&&s<o.length;s++)o[s]&&(o[s].__=e,t=bt(o[s],t,n));return t}e.__e!=t&&(t&&e.type&&!t.parentNode&&(t=E(e)),t=n.insertBefore(e.__e,t||null));do t=t&&t.nextSibling;while(t!=null&&t.nodeType==8);return t}function Gt(e,t,n,o){var s,_,a,l=e.key,c=e.type,i=t[n],u=i!=null&&(2&i.__u)==0;if(i===null&&l==null||u&&l==i.key&&c==i.type)return n;if(o>(u?1:0)){for(s=n-1,_=n+1;s>=0||_<t.length;)if((i=t[a=s>=0?s--:_++])!=null&&!(2&i.__u)&&l==i.key&&c==i.type)return a}return-1}function pt(e,t,n){t[0]=="-"?e.setProperty(t,n??""):e[t]=n==null?"":typeof n!="number"||jt.test(t)?n:n+"px"}function O(e,t,n,o,s){var _,a;t:if(t=="style")if(typeof n=="string")e.style.cssText=n;else{if(typeof o=="string"&&(e.style.cssText=o=""),o)for(t in o)n&&t in n||pt(e.style,t,"");if(n)for(t in n)o&&n[t]==o[t]||pt(e.style,t,n[t])}else if(t[0]=="o"&&t[1]=="n")_=t!=(t=t.replace(yt,"$1")),a=t.toLowerCase(),t=a in e||t=="onFocusOut"||t=="onFocusIn"?a.slice(2):t.slice(2),e.l||(e.l={}),e.l[t+_]=n,n?o?n[D]=o[D]:(n[D]=Z,e.addEventListener(t,_?Y:K,_)):e.removeEventListener(t,_?Y:K,_);else{if(s=="http://www.w3.org/2000/svg")t=t.replace(/xlink(H|:h)/,"h").replace(/sName$/,"s");else if(t!="width"&&t!="height"&&t!="href"&&t!="list"&&t!="form"&&t!="tabIndex"&&t!="download"&&t!="rowSpan"&&t!="colSpan"&&t!="role"&&t!="popover"&&t in e)try{e[t]=n??"";break t}catch{}typeof n=="function"||(n==null||n===!1&&t[4]!="-"?e.removeAttribute(t):e.setAttribute(t,t=="popover"&&n==1?"":n))}}function ft(e){return function(t){if(this.l){var n=this.l[t.type+e];if(t[q]==null)t[q]=Z++;else if(t[q]<n[D])return;return n($.event?$.event(t):t)}}}function nt(e,t,n,o,s,_,a,l,c,i){var u,p,r,d,v,f,y,m,h,w,A,N,M,ct,F,Q,S=t.type;if(t.constructor!==void 0)return null;128&n.__u&&(c=!!(32&n.__u),_=[l=t.__e=n.__e]),(u=$.__b)&&u(t);t:if(typeof S=="function"){p=a.length;try{if(h=t.props,w=S.prototype&&S.prototype.render,A=(u=S.contextType)&&o[u.__c],N=u?A?A.props.value:u.__:o,n.__c?m=(r=t.__c=n.__c).__=r.__E:(w?t.__c=r=new S(h,N):(t.__c=r=new I(h,N),r.constructor=S,r.render=Xt),A&&A.sub(r),r.state||(r.state={}),r.__n=o,d=r.__d=!0,r.__h=[],r._sb=[]),w&&r.__s==null&&(r.__s=r.state),w&&S.getDerivedStateFromProps!=null&&(r.__s==r.state&&(r.__s=C({},r.__s)),C(r.__s,S.getDerivedStateFromProps(h,r.__s))),v=r.props,f=r.state,r.__v=t,d)w&&S.getDerivedStateFromProps==null&&r.componentWillMount!=null&&r.componentWillMount(),w&&r.componentDidMount!=null&&r.__h.push(r.componentDidMount);else{if(w&&S.getDerivedStateFromProps==null&&h!==v&&r.componentWillReceiveProps!=null&&r.componentWillReceiveProps(h,N),t.__v==n.__v||!r.__e&&r.shouldComponentUpdate!=null&&r.shouldComponentUpdate(h,r.__s,N)===!1){t.__v!=n.__v&&(r.props=h,r.state=r.__s,r.__d=!1),t.__e=n.__e,t.__k=n.__k,t.__k.some(function(H){H&&(H.__=t)}),J.push.apply(r.__h,r._sb),r._sb=[],r.__h.length&&a.push(r),l=E(n);break t}r.componentWillUpdate!=null&&r.componentWillUpdate(h,r.__s,N),w&&r.componentDidUpdate!=null&&r.__h.push(function(){r.componentDidUpdate(v,f,y)})}if(r.context=N,r.props=h,r.__P=e,r.__e=!1,M=$.__r,ct=0,w)r.state=r.__s,r.__d=!1,M&&M(t),u=r.render(r.props,r.state,r.context),J.push.apply(r.__h,r._sb),r._sb=[];else do r.__d=!1,M&&M(t),u=r.render(r.props,r.state,r.context),r.state=r.__s;while(r.__d&&++ct<25);r.state=r.__s,r.getChildContext!=null&&(o=C(C({},o),r.getChildContext())),w&&!d&&r.getSnapshotBeforeUpdate!=null&&(y=r.getSnapshotBeforeUpdate(v,f)),F=u!=null&&u.type===z&&u.key==null?xt(u.props.children):u,l=$t(e,V(F)?F:[F],t,n,o,s,_,a,l,c,i),r.base=t.__e,t.__u&=-161,r.__h.length&&a.push(r),m&&(r.__E=r.__=null)}catch(H){if(a.length=p,t.__v=null,c||_!=null){if(H.then){for(t.__u|=c?160:128;l&&l.nodeType==8&&l.nextSibling;)l=l.nextSibling;_!=null&&(_[_.indexOf(l)]=null),t.__e=l}else if(_!=null)for(Q=_.length;Q--;)tt(_[Q])}else t.__e=n.__e;t.__k==null&&(t.__k=n.__k||[]),H.then||kt(t),$.__e(H,t,n)}}else _==null&&t.__v==n.__v?(t.__k=n.__k,t.__e=n.__e):l=t.__e=Qt(n.__e,t,n,o,s,_,a,c,i);return(u=$.diffed)&&u(t),128&t.__u?void 0:l}function kt(e){e&&(e.__c&&(e.__c.__e=!0),e.__k&&e.__k.some(kt))}function wt(e,t,n){for(var o=0;o<n.length;o++)_t(n[o],n[++o],n[++o]);$.__c&&$.__c(t,e),e.some(function(s){try{e=s.__h,s.__h=[],e.some(function(_){_.call(s)})}catch(_){$.__e(_,s.__v)}})}function xt(e){return typeof e!="object"||e==null||e.__b>0?e:V(e)?e.map(xt):e.constructor!==void 0?null:C({},e)}function Qt(e,t,n,o,s,_,a,l,c){var i,u,p,r,d,v,f,y=n.props||R,m=t.props,h=t.type;if(h=="svg"?s="http://www.w3.org/2000/svg":h=="math"?s="http://www.w3.org/1998/Math/MathML":s||(s="http://www.w3.org/1999/xhtml"),_!=null){for(i=0;i<_.length;i++)if((d=_[i])&&"setAttribute"in d==!!h&&(h?d.localName==h:d.nodeType==3)){e=d,_[i]=null;break}}if(e==null){if(h==null)return document.createTextNode(m);e=document.createElementNS(s,h,m.is&&m),l&&($.__m&&$.__m(t,_),l=!1),_=null}if(h==null)y===m||l&&e.data==m||(e.data=m);else{if(_=h=="textarea"&&m.defaultValue!=null?null:_&&j.call(e.childNodes),!l&&_!=null)for(y={},i=0;i<e.attributes.length;i++)y[(d=e.attributes[i]).name]=d.value;for(i in y)d=y[i],i=="dangerouslySetInnerHTML"?p=d:i=="children"||i in m||i=="value"&&"defaultValue"in m||i=="checked"&&"defaultChecked"in m||O(e,i,null,d,s);for(i in m)d=m[i],i=="children"?r=d:i=="dangerouslySetInnerHTML"?u=d:i=="value"?v=d:i=="checked"?f=d:l&&typeof d!="function"||y[i]===d||O(e,i,d,y[i],s);if(u)l||p&&(u.__html==p.__html||u.__html==e.innerHTML)||(e.innerHTML=u.__html),t.__k=[];else if(p&&(e.innerHTML=""),$t(t.type=="template"?e.content:e,V(r)?r:[r],t,n,o,h=="foreignObject"?"http://www.w3.org/1999/xhtml":s,_,a,_?_[0]:n.__k&&E(n,0),l,c),_!=null)for(i=_.length;i--;)tt(_[i]);l&&h!="textarea"||(i="value",h=="progress"&&v==null?e.removeAttribute("value"):v!=null&&(v!==e[i]||h=="progress"&&!v||h=="option"&&v!=y[i])&&O(e,i,v,y[i],s),i="checked",f!=null&&f!=e[i]&&O(e,i,f,y[i],s))}return e}function _t(e,t,n){try{if(typeof e=="function"){var o=typeof e.__u=="function";o&&e.__u(),o&&t==null||(e.__u=e(t))}else e.current=t}catch(s){$.__e(s,n)}}function St(e,t,n){var o,s;if($.unmount&&$.unmount(e),(o=e.ref)&&(o.current&&o.current!=e.__e||_t(o,null,t)),(o=e.__c)!=null){if(o.componentWillUnmount)try{o.componentWillUnmount()}catch(_){$.__e(_,t)}o.base=o.__P=o.__n=null}if(o=e.__k)for(s=0;s<o.length;s++)o[s]&&St(o[s],t,n||typeof e.type!="function");n||tt(e.__e),e.__c=e.__=e.__e=void 0}function Xt(e,t,n){return this.constructor(e,n)}function Ct(e,t,n){var o,s,_,a;t==document&&(t=document.documentElement),$.__&&$.__(e,t),s=(o=typeof n=="function")?null:n&&n.__k||t.__k,_=[],a=[],nt(t,e=(!o&&n||t).__k=et(z,null,[e]),s||R,R,t.namespaceURI,!o&&n?[n]:s?null:t.firstChild?j.call(t.childNodes):null,_,!o&&n?n:s?s.__e:t.firstChild,o,a),wt(_,e,a),e.props.children=null}j=J.slice,$={__e:function(e,t,n,o){for(var s,_,a;t=t.__;)if((s=t.__c)&&!s.__)try{if((_=s.constructor)&&_.getDerivedStateFromError!=null&&(s.setState(_.getDerivedStateFromError(e)),a=s.__d),s.componentDidCatch!=null&&(s.componentDidCatch(e,o||{}),a=s.__d),a)return s.__E=s}catch(l){e=l}throw e}},ht=0,Jt=function(e){return e!=null&&e.constructor===void 0},I.prototype.setState=function(e,t){var n;n=this.__s!=null&&this.__s!=this.state?this.__s:this.__s=C({},this.state),typeof e=="function"&&(e=e(C({},n),this.props)),e&&C(n,e),e!=null&&this.__v&&(t&&this._sb.push(t),dt(this))},I.prototype.forceUpdate=function(e){this.__v&&(this.__e=!0,e&&this.__h.push(e),dt(this))},I.prototype.render=z,P=[],mt=typeof Promise=="function"?Promise.prototype.then.bind(Promise.resolve()):setTimeout,vt=function(e,t){return e.__v.__b-t.__v.__b},B.__r=0,X=Math.random().toString(8),q="__d"+X,D="__a"+X,yt=/(PointerCapture)$|Capture$/i,Z=0,K=ft(!1),Y=ft(!0),Bt=0;var L,b,ot,Pt,rt=0,Lt=[],k=$,At=k.__b,Nt=k.__r,Et=k.diffed,Ht=k.__c,Tt=k.unmount,Mt=k.__;function at(e,t){k.__h&&k.__h(b,e,rt||t),rt=0;var n=b.__H||(b.__H={__:[],__h:[]});return e>=n.__.length&&n.__.push({}),n.__[e]}function x(e){return rt=1,Kt(Ot,e)}function Kt(e,t,n){var o=at(L++,2);if(o.t=e,!o.__c&&(o.__=[n?n(t):Ot(void 0,t),function(l){var c=o.__N?o.__N[0]:o.__[0],i=o.t(c,l);c!==i&&(o.__N=[i,o.__[1]],o.__c.setState({}))}],o.__c=b,!b.__f)){var s=function(l,c,i){if(!o.__c.__H)return!0;var u=!1,p=o.__c.props!==l;if(o.__c.__H.__.some(function(d){if(d.__N){u=!0;var v=d.__[0];d.__=d.__N,d.__N=void 0,v!==d.__[0]&&(p=!0)}}),_){var r=_.call(this,l,c,i);return u?r||p:r}return!u||p};b.__f=!0;var _=b.shouldComponentUpdate,a=b.componentWillUpdate;b.componentWillUpdate=function(l,c,i){if(this.__e){var u=_;_=void 0,s(l,c,i),_=u}a&&a.call(this,l,c,i)},b.shouldComponentUpdate=s}return o.__N||o.__}function U(e,t){var n=at(L++,3);!k.__s&&Ft(n.__H,t)&&(n.__=e,n.u=t,b.__H.__h.push(n))}function Ut(e,t){var n=at(L++,7);return Ft(n.__H,t)&&(n.__=e(),n.__H=t,n.__h=e),n.__}function Yt(){for(var e;e=Lt.shift();){var t=e.__H;if(e.__P&&t)try{t.__h.some(G),t.__h.some(st),t.__h=[]}catch(n){t.__h=[],k.__e(n,e.__v)}}}k.__b=function(e){b=null,At&&At(e)},k.__=function(e,t){e&&t.__k&&t.__k.__m&&(e.__m=t.__k.__m),Mt&&Mt(e,t)},k.__r=function(e){Nt&&Nt(e),L=0;var t=(b=e.__c).__H;t&&(ot===b?(t.__h=[],b.__h=[],t.__.some(function(n){n.__N&&(n.__=n.__N),n.u=n.__N=void 0})):(t.__h.some(G),t.__h.some(st),t.__h=[],L=0)),ot=b},k.diffed=function(e){Et&&Et(e);var t=e.__c;t&&t.__H&&(t.__H.__h.length&&(Lt.push(t)!==1&&Pt===k.requestAnimationFrame||((Pt=k.requestAnimationFrame)||Zt)(Yt)),t.__H.__.some(function(n){n.u&&(n.__H=n.u,n.u=void 0)})),ot=b=null},k.__c=function(e,t){t.some(function(n){try{n.__h.some(G),n.__h=n.__h.filter(function(o){return!o.__||st(o)})}catch(o){t.some(function(s){s.__h&&(s.__h=[])}),t=[],k.__e(o,n.__v)}}),Ht&&Ht(e,t)},k.unmount=function(e){Tt&&Tt(e);var t,n=e.__c;n&&n.__H&&(n.__H.__.some(function(o){try{G(o)}catch(s){t=s}}),n.__H=void 0,t&&k.__e(t,n.__v))};var Dt=typeof requestAnimationFrame=="function";function Zt(e){var t,n=function(){clearTimeout(o),Dt&&cancelAnimationFrame(t),setTimeout(e)},o=setTimeout(n,35);Dt&&(t=requestAnimationFrame(n))}function G(e){var t=b,n=e.__c;typeof n=="function"&&(e.__c=void 0,n()),b=t}function st(e){var t=b;e.__c=e.__(),b=t}function Ft(e,t){return!e||e.length!==t.length||t.some(function(n,o){return n!==e[o]})}function Ot(e,t){return typeof t=="function"?t(e):t}var Wt=function(e,t,n,o){var s;t[0]=0;for(var _=1;_<t.length;_++){var a=t[_++],l=t[_]?(t[0]|=a?1:2,n[t[_++]]):t[++_];a===3?o[0]=l:a===4?o[1]=Object.assign(o[1]||{},l):a===5?(o[1]=o[1]||{})[t[++_]]=l:a===6?o[1][t[++_]]+=l+"":a?(s=e.apply(l,Wt(e,l,n,["",null])),o.push(s),l[0]?t[0]|=2:(t[_-2]=0,t[_]=s)):o.push(l)}return o},qt=new Map;function It(e){var t=qt.get(this);return t||(t=new Map,qt.set(this,t)),(t=Wt(this,t.get(e)||(t.set(e,t=function(n){for(var o,s,_=1,a="",l="",c=[0],i=function(r){_===1&&(r||(a=a.replace(/^\s*\n\s*|\s*\n\s*$/g,"")))?c.push(0,r,a):_===3&&(r||a)?(c.push(3,r,a),_=2):_===2&&a==="..."&&r?c.push(4,r,0):_===2&&a&&!r?c.push(5,0,!0,a):_>=5&&((a||!r&&_===5)&&(c.push(_,0,a,s),_=6),r&&(c.push(_,r,0,s),_=6)),a=""},u=0;u<n.length;u++){u&&(_===1&&i(),i(u));for(var p=0;p<n[u].length;p++)o=n[u][p],_===1?o==="<"?(i(),c=[c],_=3):a+=o:_===4?a==="--"&&o===">"?(_=1,a=""):a=o+a[0]:l?o===l?l="":a+=o:o==='"'||o==="'"?l=o:o===">"?(i(),_=1):_&&(o==="="?(_=5,s=a,a=""):o==="/"&&(_<5||n[u][p+1]===">")?(i(),_===3&&(c=c[0]),_=c,(c=c[0]).push(2,0,_),_=0):o===" "||o==="	"||o===`
`||o==="\r"?(i(),_=2):a+=o),_===3&&a==="!--"&&(_=4,c=c[0])}return i(),c}(e)),t),arguments,[])).length>1?t:t[0]}var g=It.bind(et),Rt={group_chat:{agent_ids:["IndustryExpertAgent","TechnicalAnalysisAgent","FundamentalAnalysisAgent"],query:"What stock should I buy?",option_label:"stocks"},handoff_workflow:{task:"Process refund for order #12345",steps:[{agent_id:"CustomerAgent"},{agent_id:"SellerAgent"},{agent_id:"PaymentAgent"},{agent_id:"NotificationAgent"}],context:{order_id:"12345"},failure_agent:"NotificationAgent"},collaborative_filtering:{agent_ids:["PriceAgent","QualityAgent","LocationAgent","ReviewsAgent"],weights:{price:.2,quality:.4,location:.3,reviews:.1},query:"Hotel in Paris near Eiffel Tower"},consensus:{problem:"Should we migrate to microservices?",wait_for_all_votes:!0},research:{query:"What is the latest lithium-ion battery recycling rate?"},route:{request_type:"stock_recommendation",query:"What stock should I buy?"},parallel:{patterns:[{name:"stocks",route:{request_type:"stock_recommendation",query:"Best stock?"}},{name:"hotels",route:{request_type:"hotel_recommendation",query:"Hotel in Paris"}}]}};async function lt(e){let t=await fetch(e);if(!t.ok)throw new Error(`${t.status} ${await t.text()}`);return t.json()}function T(e,t=2){return typeof e=="number"?e.toFixed(t):"\u2013"}function it({title:e,points:t,series:n,unit:o}){let l=t.flatMap(p=>n.map(r=>p[r.key]||0)),c=Math.max(1e-9,...l)*1.1,i=p=>t.map((r,d)=>{let v=28+d/Math.max(1,t.length-1)*426,f=140-28/2-(r[p]||0)/c*112;return`${d?"L":"M"}${v.toFixed(1)},${f.toFixed(1)}`}).join(" "),u=t[t.length-1]||{};return g`<figure class="chart" data-chart=${e}>
    <figcaption>
      ${e}
      ${n.map(p=>g`<span class="legend" style=${`color:${p.color}`}
          >${p.label} ${T(u[p.key])} ${o}</span
        >`)}
    </figcaption>
    <svg viewBox=${"0 0 460 140"} role="img" aria-label=${e}>
      <text x="2" y="12" class="axis">${T(c,1)}</text>
      <text x="2" y=${136} class="axis">0</text>
      ${n.map(p=>g`<path d=${i(p.key)} fill="none" stroke=${p.color} stroke-width="1.8" />`)}
    </svg>
  </figure>`}function te({agents:e}){return g`<section>
    <h2>Agents <small>${e.length}</small></h2>
    <table id="agents">
      <thead>
        <tr>
          <th>agent</th><th>types</th><th>health</th><th>HIGH</th><th>MEDIUM</th><th>LOW</th>
          <th>in flight</th><th>dead</th><th>address</th>
        </tr>
      </thead>
      <tbody>
        ${e.map(t=>g`<tr data-agent=${t.agent_id}>
            <td class="id">${t.agent_id}</td>
            <td>${t.agent_types.join(", ")}</td>
            <td class=${`health ${t.health}`}>${t.health}</td>
            <td>${t.high}</td><td>${t.medium}</td><td>${t.low}</td>
            <td>${t.in_flight}</td><td>${t.dead_letters}</td>
            <td class="addr">${t.address}</td>
          </tr>`)}
      </tbody>
    </table>
  </section>`}function ee({trace:e}){if(!e)return null;if(!e.spans.length)return g`<p class="note">${e.note||"no spans"}</p>`;let t=new Set(e.critical_path),n=Math.max(e.total_ms,1e-6);return g`<div class="waterfall" id="waterfall">
    <p>${e.spans.length} spans, ${T(e.total_ms)} ms; critical path highlighted</p>
    ${e.spans.map(o=>g`<div class=${`span ${t.has(o.span_id)?"critical":""}`}
        data-span=${o.span_id}>
        <span class="label" title=${o.service}>${o.name}</span>
        <span class="track">
          <span
            class="bar"
            style=${`left:${o.offset_ms/n*100}%;width:${Math.max(.4,o.duration_ms/n*100)}%`}
          ></span>
        </span>
        <span class="ms">${T(o.duration_ms)} ms</span>
      </div>`)}
  </div>`}function ne(e,t){let n=T(t.accuracy*100,0);return`${e} accuracy ${n}% (${t.satisfied} of ${t.rated} rated runs)`}function _e({run:e,state:t}){let[n,o]=x(""),[s,_]=x(null);if(U(()=>_(null),[e.run_id]),!t.allow_runs||!["COMPLETED","PARTIAL"].includes(e.status))return null;let a=async l=>{let c={"Content-Type":"application/json"};n&&(c.Authorization=`Bearer ${n}`);let i=await fetch(`/api/runs/${e.run_id}/feedback`,{method:"POST",headers:c,body:JSON.stringify({satisfied:l})}),u=await i.text();try{let p=JSON.parse(u);_(i.ok?{ok:!0,...p}:{ok:!1,message:p.message||u})}catch{_({ok:!1,message:u})}};return g`<p id="feedback">
    Did this outcome satisfy you?
    ${t.credential_required&&g`<input
      id="feedback-token"
      type="password"
      placeholder="gateway credential"
      value=${n}
      onInput=${l=>o(l.target.value)}
    />`}
    <button id="satisfied" onClick=${()=>a(!0)}>Yes</button>
    <button id="not-satisfied" onClick=${()=>a(!1)}>No</button>
    ${s&&(s.ok?g`<span id="accuracy">${ne(e.pattern,s)}</span>`:g`<span class="error" id="feedback-error">${s.message}</span>`)}
  </p>`}function oe({run:e,events:t,state:n}){let[o,s]=x(null);return U(()=>s(null),[e.run_id]),g`<section id="run-detail" data-run=${e.run_id}>
    <h2>
      ${e.pattern} <code>${e.run_id}</code>
      <span class=${`status ${e.status}`}>${e.status}</span>
      <button
        id="show-trace"
        onClick=${async()=>s(await lt(`/api/traces/${e.run_id}`))}
      >
        Trace waterfall
      </button>
    </h2>
    <ol class="events">
      ${t.map(_=>g`<li class=${`event ${_.kind}`} data-kind=${_.kind}>
          <span class="kind">${_.kind}</span>
          ${_.agent_id&&g`<span class="agent">${_.agent_id}</span>`}
          <span class="summary">${_.summary}</span>
          <span class="ms">${T(_.elapsed_ms,1)} ms</span>
        </li>`)}
    </ol>
    <${_e} run=${e} state=${n} />
    <${ee} trace=${o} />
  </section>`}function re({state:e,onStarted:t}){let[n,o]=x("group_chat"),[s,_]=x(JSON.stringify(Rt.group_chat,null,2)),[a,l]=x(""),[c,i]=x("");if(!e.allow_runs)return g`<section><p class="note">Read-only dashboard.</p></section>`;let u=r=>{o(r),_(JSON.stringify(Rt[r]||{},null,2))};return g`<section>
    <h2>Start a pattern</h2>
    <form id="start" onSubmit=${async r=>{r.preventDefault(),i("");let d;try{d=JSON.parse(s)}catch(m){i(`not JSON: ${m.message}`);return}let v={"Content-Type":"application/json"};a&&(v.Authorization=`Bearer ${a}`);let f=await fetch(`/api/patterns/${n}`,{method:"POST",headers:v,body:JSON.stringify(d)}),y=await f.text();if(!f.ok){try{i(JSON.parse(y).message||y)}catch{i(y)}return}t(JSON.parse(y).run_id)}}>
      <select id="pattern" value=${n} onChange=${r=>u(r.target.value)}>
        ${e.patterns.map(r=>g`<option value=${r}>${r}</option>`)}
      </select>
      ${e.credential_required&&g`<input
        id="token"
        type="password"
        placeholder="gateway credential"
        value=${a}
        onInput=${r=>l(r.target.value)}
      />`}
      <textarea id="body" rows="8" value=${s} onInput=${r=>_(r.target.value)} />
      <button id="run" type="submit">Start</button>
      ${c&&g`<p class="error" id="start-error">${c}</p>`}
    </form>
  </section>`}function se(){let[e,t]=x(null),n=async()=>t(await lt("/api/dead-letters"));return U(()=>{n()},[]),g`<section>
    <h2>Dead letters <button onClick=${n}>Refresh</button></h2>
    ${e&&(e.length?g`<table id="dead-letters">
          <thead><tr><th>message</th><th>from</th><th>to</th><th>reason</th><th>at</th></tr></thead>
          <tbody>
            ${e.map(o=>g`<tr>
                <td><code>${o.message_id}</code></td><td>${o.from_agent}</td>
                <td>${o.to_agent}</td><td>${o.reason}</td><td>${o.dead_lettered_at}</td>
              </tr>`)}
          </tbody>
        </table>`:g`<p class="note" id="dead-letters">none</p>`)}
  </section>`}function ae(){let[e,t]=x(null),[n,o]=x([]),[s,_]=x([]),[a,l]=x(null),[c,i]=x({}),[u,p]=x(!1);U(()=>{let f=new EventSource("/api/events");return f.addEventListener("open",()=>p(!0)),f.addEventListener("error",()=>p(!1)),f.addEventListener("state",y=>{let m=JSON.parse(y.data);t(m),o(m.history),_(m.runs)}),f.addEventListener("snapshot",y=>{let m=JSON.parse(y.data);t(h=>({...h,...m})),o(h=>[...h.slice(-299),m.point])}),f.addEventListener("event",y=>{let{run:m,event:h}=JSON.parse(y.data);_(w=>[m,...w.filter(A=>A.run_id!==m.run_id)].slice(0,50)),i(w=>({...w,[m.run_id]:[...w[m.run_id]||[],h]}))}),()=>f.close()},[]);let r=async f=>{l(f);try{let y=await lt(`/api/runs/${f}`);i(m=>{let h=m[f]||[];return{...m,[f]:y.events.length>=h.length?y.events:h}})}catch{}},d=Ut(()=>s.find(f=>f.run_id===a),[s,a]);if(!e)return g`<p class="note">connecting…</p>`;let v=e.totals||{};return g`<main>
    <header>
      <h1>agentmesh</h1>
      <span id="live" class=${u?"live":"offline"}>${u?"live":"offline"}</span>
      <span>held <b>${v.held}</b></span>
      <span>sent <b>${v.sent_count}</b></span>
      <span>delivered <b>${v.delivered_count}</b></span>
      <span>expired <b>${v.expired_count}</b></span>
      <span>dead <b>${v.dead_lettered_count}</b></span>
    </header>
    <div class="charts">
      <${it}
        title="Messages per second"
        points=${n}
        unit="/s"
        series=${[{key:"sent_per_s",label:"sent",color:"#2563eb"},{key:"delivered_per_s",label:"delivered",color:"#16a34a"}]}
      />
      <${it}
        title="Send latency"
        points=${n}
        unit="ms"
        series=${[{key:"send_p50_ms",label:"p50",color:"#2563eb"},{key:"send_p95_ms",label:"p95",color:"#d97706"},{key:"send_p99_ms",label:"p99",color:"#dc2626"}]}
      />
      <${it}
        title="Request/response latency"
        points=${n}
        unit="ms"
        series=${[{key:"roundtrip_p50_ms",label:"p50",color:"#2563eb"},{key:"roundtrip_p95_ms",label:"p95",color:"#d97706"},{key:"roundtrip_p99_ms",label:"p99",color:"#dc2626"}]}
      />
    </div>
    <${te} agents=${e.agents||[]} />
    <div class="columns">
      <section>
        <h2>Pattern runs</h2>
        <ul id="runs">
          ${s.map(f=>g`<li
              class=${`run ${f.run_id===a?"selected":""}`}
              data-run=${f.run_id}
              onClick=${()=>r(f.run_id)}
            >
              <span class="pattern">${f.pattern}</span> <code>${f.run_id}</code>
              <span class=${`status ${f.status}`}>${f.status}</span>
            </li>`)}
        </ul>
      </section>
      <${re} state=${e} onStarted=${r} />
    </div>
    ${d&&g`<${oe} run=${d} events=${c[d.run_id]||[]} state=${e} />`}
    <${se} />
  </main>`}Ct(g`<${ae} />`,document.getElementById("app"));
