var B,g,ht,Jt,P,ut,mt,vt,X,W,T,yt,Z,K,Y,Bt,R={},I=[],jt=/acit|ex(?:s|g|n|p|$)|rph|grid|ows|mnc|ntw|ine[ch]|zoo|^ord|itera/i,j=Array.isArray;function C(e,t){for(var n in t)e[n]=t[n];return e}function tt(e){e&&e.parentNode&&e.parentNode.removeChild(e)}function et(e,t,n){var _,s,r,a={};for(r in t)r=="key"?_=t[r]:r=="ref"?s=t[r]:a[r]=t[r];if(arguments.length>2&&(a.children=arguments.length>3?B.call(arguments,2):n),typeof e=="function"&&e.defaultProps!=null)for(r in e.defaultProps)a[r]===void 0&&(a[r]=e.defaultProps[r]);return q(e,a,_,s,null)}function q(e,t,n,_,s){var r={type:e,props:t,key:n,ref:_,__k:null,__:null,__b:0,__e:null,__c:null,constructor:void 0,__v:s??++ht,__i:-1,__u:0};return s==null&&g.vnode!=null&&g.vnode(r),r}function V(e){return e.children}function O(e,t){this.props=e,this.context=t}function N(e,t){if(t==null)return e.__?N(e.__,e.__i+1):null;for(var n;t<e.__k.length;t++)if((n=e.__k[t])!=null&&n.__e!=null)return n.__e;return typeof e.type=="function"?N(e):null}function Vt(e){if(e.__P&&e.__d){var t=e.__v,n=t.__e,_=[],s=[],r=C({},t);r.__v=t.__v+1,g.vnode&&g.vnode(r),nt(e.__P,r,t,e.__n,e.__P.namespaceURI,32&t.__u?[n]:null,_,n??N(t),!!(32&t.__u),s),r.__v=t.__v,r.__.__k[r.__i]=r,wt(_,r,s),t.__e=t.__=null,r.__e!=n&&gt(r)}}function gt(e){if((e=e.__)!=null&&e.__c!=null)return e.__e=e.__c.base=null,e.__k.some(function(t){if(t!=null&&t.__e!=null)return e.__e=e.__c.base=t.__e}),gt(e)}function dt(e){(!e.__d&&(e.__d=!0)&&P.push(e)&&!J.__r++||ut!=g.debounceRendering)&&((ut=g.debounceRendering)||mt)(J)}function J(){try{for(var e,t=1;P.length;)P.length>t&&P.sort(vt),e=P.shift(),t=P.length,Vt(e)}finally{P.length=J.__r=0}}function $t(e,t,n,_,s,r,a,l,c,i,d){var p,o,u,v,f,y,m=_&&_.__k||I,h=t.length;for(c=zt(n,t,m,c,h),p=0;p<h;p++)(u=n.__k[p])!=null&&(o=u.__i!=-1&&m[u.__i]||R,u.__i=p,y=nt(e,u,o,s,r,a,l,c,i,d),v=u.__e,u.ref&&o.ref!=u.ref&&(o.ref&&_t(o.ref,null,u),d.push(u.ref,u.__c||v,u)),f==null&&v!=null&&(f=v),4&u.__u?(c=bt(u,c,e),o.__e&&(o.__e=null)):typeof u.type=="function"&&y!==void 0?c=y:v&&(c=v.nextSibling),u.__u&=-7);return n.__e=f,c}function zt(e,t,n,_,s){var r,a,l,c,i,d=n.length,p=d,o=0;for(e.__k=new Array(s),r=0;r<s;r++)(a=t[r])!=null&&typeof a!="boolean"&&typeof a!="function"?(typeof a=="string"||typeof a=="number"||typeof a=="bigint"||a.constructor==String?a=e.__k[r]=q(null,a,null,null,null):j(a)?a=e.__k[r]=q(V,{children:a},null,null,null):a.constructor===void 0&&a.__b>0?a=e.__k[r]=q(a.type,a.props,a.key,a.ref?a.ref:null,a.__v):e.__k[r]=a,c=r+o,a.__=e,a.__b=e.__b+1,l=null,(i=a.__i=Gt(a,n,c,p))!=-1&&(p--,(l=n[i])&&(l.__u|=2)),l==null||l.__v==null?(i==-1&&(s>d?o--:s<d&&o++),typeof a.type!="function"&&(a.__u|=4)):i!=c&&(i==c-1?o--:i==c+1?o++:(i>c?o--:o++,a.__u|=4))):e.__k[r]=null;if(p)for(r=0;r<d;r++)(l=n[r])!=null&&!(2&l.__u)&&(l.__e==_&&(_=N(l)),St(l,l));return _}function bt(e,t,n){var _,s;if(typeof e.type=="function"){for(_=e.__k,s=0;_&&s<_.length;s++)_[s]&&(_[s].__=e,t=bt(_[s],t,n));return t}e.__e!=t&&(t&&e.type&&!t.parentNode&&(t=N(e)),t=n.insertBefore(e.__e,t||null));do t=t&&t.nextSibling;while(t!=null&&t.nodeType==8);return t}function Gt(e,t,n,_){var s,r,a,l=e.key,c=e.type,i=t[n],d=i!=null&&(2&i.__u)==0;if(i===null&&l==null||d&&l==i.key&&c==i.type)return n;if(_>(d?1:0)){for(s=n-1,r=n+1;s>=0||r<t.length;)if((i=t[a=s>=0?s--:r++])!=null&&!(2&i.__u)&&l==i.key&&c==i.type)return a}return-1}function pt(e,t,n){t[0]=="-"?e.setProperty(t,n??""):e[t]=n==null?"":typeof n!="number"||jt.test(t)?n:n+"px"}function F(e,t,n,_,s){var r,a;t:if(t=="style")if(typeof n=="string")e.style.cssText=n;else{if(typeof _=="string"&&(e.style.cssText=_=""),_)for(t in _)n&&t in n||pt(e.style,t,"");if(n)for(t in n)_&&n[t]==_[t]||pt(e.style,t,n[t])}else if(t[0]=="o"&&t[1]=="n")r=t!=(t=t.replace(yt,"$1")),a=t.toLowerCase(),t=a in e||t=="onFocusOut"||t=="onFocusIn"?a.slice(2):t.slice(2),e.l||(e.l={}),e.l[t+r]=n,n?_?n[T]=_[T]:(n[T]=Z,e.addEventListener(t,r?Y:K,r)):e.removeEventListener(t,r?Y:K,r);else{if(s=="http://www.w3.org/2000/svg")t=t.replace(/xlink(H|:h)/,"h").replace(/sName$/,"s");else if(t!="width"&&t!="height"&&t!="href"&&t!="list"&&t!="form"&&t!="tabIndex"&&t!="download"&&t!="rowSpan"&&t!="colSpan"&&t!="role"&&t!="popover"&&t in e)try{e[t]=n??"";break t}catch{}typeof n=="function"||(n==null||n===!1&&t[4]!="-"?e.removeAttribute(t):e.setAttribute(t,t=="popover"&&n==1?"":n))}}function ft(e){return function(t){if(this.l){var n=this.l[t.type+e];if(t[W]==null)t[W]=Z++;else if(t[W]<n[T])return;return n(g.event?g.event(t):t)}}}function nt(e,t,n,_,s,r,a,l,c,i){var d,p,o,u,v,f,y,m,h,w,A,E,M,ct,U,Q,S=t.type;if(t.constructor!==void 0)return null;128&n.__u&&(c=!!(32&n.__u),r=[l=t.__e=n.__e]),(d=g.__b)&&d(t);t:if(typeof S=="function"){p=a.length;try{if(h=t.props,w=S.prototype&&S.prototype.render,A=(d=S.contextType)&&_[d.__c],E=d?A?A.props.value:d.__:_,n.__c?m=(o=t.__c=n.__c).__=o.__E:(w?t.__c=o=new S(h,E):(t.__c=o=new O(h,E),o.constructor=S,o.render=Xt),A&&A.sub(o),o.state||(o.state={}),o.__n=_,u=o.__d=!0,o.__h=[],o._sb=[]),w&&o.__s==null&&(o.__s=o.state),w&&S.getDerivedStateFromProps!=null&&(o.__s==o.state&&(o.__s=C({},o.__s)),C(o.__s,S.getDerivedStateFromProps(h,o.__s))),v=o.props,f=o.state,o.__v=t,u)w&&S.getDerivedStateFromProps==null&&o.componentWillMount!=null&&o.componentWillMount(),w&&o.componentDidMount!=null&&o.__h.push(o.componentDidMount);else{if(w&&S.getDerivedStateFromProps==null&&h!==v&&o.componentWillReceiveProps!=null&&o.componentWillReceiveProps(h,E),t.__v==n.__v||!o.__e&&o.shouldComponentUpdate!=null&&o.shouldComponentUpdate(h,o.__s,E)===!1){t.__v!=n.__v&&(o.props=h,o.state=o.__s,o.__d=!1),t.__e=n.__e,t.__k=n.__k,t.__k.some(function(H){H&&(H.__=t)}),I.push.apply(o.__h,o._sb),o._sb=[],o.__h.length&&a.push(o),l=N(n);break t}o.componentWillUpdate!=null&&o.componentWillUpdate(h,o.__s,E),w&&o.componentDidUpdate!=null&&o.__h.push(function(){o.componentDidUpdate(v,f,y)})}if(o.context=E,o.props=h,o.__P=e,o.__e=!1,M=g.__r,ct=0,w)o.state=o.__s,o.__d=!1,M&&M(t),d=o.render(o.props,o.state,o.context),I.push.apply(o.__h,o._sb),o._sb=[];else do o.__d=!1,M&&M(t),d=o.render(o.props,o.state,o.context),o.state=o.__s;while(o.__d&&++ct<25);o.state=o.__s,o.getChildContext!=null&&(_=C(C({},_),o.getChildContext())),w&&!u&&o.getSnapshotBeforeUpdate!=null&&(y=o.getSnapshotBeforeUpdate(v,f)),U=d!=null&&d.type===V&&d.key==null?xt(d.props.children):d,l=$t(e,j(U)?U:[U],t,n,_,s,r,a,l,c,i),o.base=t.__e,t.__u&=-161,o.__h.length&&a.push(o),m&&(o.__E=o.__=null)}catch(H){if(a.length=p,t.__v=null,c||r!=null){if(H.then){for(t.__u|=c?160:128;l&&l.nodeType==8&&l.nextSibling;)l=l.nextSibling;r!=null&&(r[r.indexOf(l)]=null),t.__e=l}else if(r!=null)for(Q=r.length;Q--;)tt(r[Q])}else t.__e=n.__e;t.__k==null&&(t.__k=n.__k||[]),H.then||kt(t),g.__e(H,t,n)}}else r==null&&t.__v==n.__v?(t.__k=n.__k,t.__e=n.__e):l=t.__e=Qt(n.__e,t,n,_,s,r,a,c,i);return(d=g.diffed)&&d(t),128&t.__u?void 0:l}function kt(e){e&&(e.__c&&(e.__c.__e=!0),e.__k&&e.__k.some(kt))}function wt(e,t,n){for(var _=0;_<n.length;_++)_t(n[_],n[++_],n[++_]);g.__c&&g.__c(t,e),e.some(function(s){try{e=s.__h,s.__h=[],e.some(function(r){r.call(s)})}catch(r){g.__e(r,s.__v)}})}function xt(e){return typeof e!="object"||e==null||e.__b>0?e:j(e)?e.map(xt):e.constructor!==void 0?null:C({},e)}function Qt(e,t,n,_,s,r,a,l,c){var i,d,p,o,u,v,f,y=n.props||R,m=t.props,h=t.type;if(h=="svg"?s="http://www.w3.org/2000/svg":h=="math"?s="http://www.w3.org/1998/Math/MathML":s||(s="http://www.w3.org/1999/xhtml"),r!=null){for(i=0;i<r.length;i++)if((u=r[i])&&"setAttribute"in u==!!h&&(h?u.localName==h:u.nodeType==3)){e=u,r[i]=null;break}}if(e==null){if(h==null)return document.createTextNode(m);e=document.createElementNS(s,h,m.is&&m),l&&(g.__m&&g.__m(t,r),l=!1),r=null}if(h==null)y===m||l&&e.data==m||(e.data=m);else{if(r=h=="textarea"&&m.defaultValue!=null?null:r&&B.call(e.childNodes),!l&&r!=null)for(y={},i=0;i<e.attributes.length;i++)y[(u=e.attributes[i]).name]=u.value;for(i in y)u=y[i],i=="dangerouslySetInnerHTML"?p=u:i=="children"||i in m||i=="value"&&"defaultValue"in m||i=="checked"&&"defaultChecked"in m||F(e,i,null,u,s);for(i in m)u=m[i],i=="children"?o=u:i=="dangerouslySetInnerHTML"?d=u:i=="value"?v=u:i=="checked"?f=u:l&&typeof u!="function"||y[i]===u||F(e,i,u,y[i],s);if(d)l||p&&(d.__html==p.__html||d.__html==e.innerHTML)||(e.innerHTML=d.__html),t.__k=[];else if(p&&(e.innerHTML=""),$t(t.type=="template"?e.content:e,j(o)?o:[o],t,n,_,h=="foreignObject"?"http://www.w3.org/1999/xhtml":s,r,a,r?r[0]:n.__k&&N(n,0),l,c),r!=null)for(i=r.length;i--;)tt(r[i]);l&&h!="textarea"||(i="value",h=="progress"&&v==null?e.removeAttribute("value"):v!=null&&(v!==e[i]||h=="progress"&&!v||h=="option"&&v!=y[i])&&F(e,i,v,y[i],s),i="checked",f!=null&&f!=e[i]&&F(e,i,f,y[i],s))}return e}function _t(e,t,n){try{if(typeof e=="function"){var _=typeof e.__u=="function";_&&e.__u(),_&&t==null||(e.__u=e(t))}else e.current=t}catch(s){g.__e(s,n)}}function St(e,t,n){var _,s;if(g.unmount&&g.unmount(e),(_=e.ref)&&(_.current&&_.current!=e.__e||_t(_,null,t)),(_=e.__c)!=null){if(_.componentWillUnmount)try{_.componentWillUnmount()}catch(r){g.__e(r,t)}_.base=_.__P=_.__n=null}if(_=e.__k)for(s=0;s<_.length;s++)_[s]&&St(_[s],t,n||typeof e.type!="function");n||tt(e.__e),e.__c=e.__=e.__e=void 0}function Xt(e,t,n){return this.constructor(e,n)}function Ct(e,t,n){var _,s,r,a;t==document&&(t=document.documentElement),g.__&&g.__(e,t),s=(_=typeof n=="function")?null:n&&n.__k||t.__k,r=[],a=[],nt(t,e=(!_&&n||t).__k=et(V,null,[e]),s||R,R,t.namespaceURI,!_&&n?[n]:s?null:t.firstChild?B.call(t.childNodes):null,r,!_&&n?n:s?s.__e:t.firstChild,_,a),wt(r,e,a),e.props.children=null}B=I.slice,g={__e:function(e,t,n,_){for(var s,r,a;t=t.__;)if((s=t.__c)&&!s.__)try{if((r=s.constructor)&&r.getDerivedStateFromError!=null&&(s.setState(r.getDerivedStateFromError(e)),a=s.__d),s.componentDidCatch!=null&&(s.componentDidCatch(e,_||{}),a=s.__d),a)return s.__E=s}catch(l){e=l}throw e}},ht=0,Jt=function(e){return e!=null&&e.constructor===void 0},O.prototype.setState=function(e,t){var n;n=this.__s!=null&&this.__s!=this.state?this.__s:this.__s=C({},this.state),typeof e=="function"&&(e=e(C({},n),this.props)),e&&C(n,e),e!=null&&this.__v&&(t&&this._sb.push(t),dt(this))},O.prototype.forceUpdate=function(e){this.__v&&(this.__e=!0,e&&this.__h.push(e),dt(this))},O.prototype.render=V,P=[],mt=typeof Promise=="function"?Promise.prototype.then.bind(Promise.resolve()):setTimeout,vt=function(e,t){return e.__v.__b-t.__v.__b},J.__r=0,X=Math.random().toString(8),W="__d"+X,T="__a"+X,yt=/(PointerCapture)$|Capture$/i,Z=0,K=ft(!1),Y=ft(!0),Bt=0;var D,b,rt,Pt,ot=0,Lt=[],k=g,At=k.__b,Et=k.__r,Nt=k.diffed,Ht=k.__c,Mt=k.unmount,Tt=k.__;function at(e,t){k.__h&&k.__h(b,e,ot||t),ot=0;var n=b.__H||(b.__H={__:[],__h:[]});return e>=n.__.length&&n.__.push({}),n.__[e]}function x(e){return ot=1,Kt(Wt,e)}function Kt(e,t,n){var _=at(D++,2);if(_.t=e,!_.__c&&(_.__=[n?n(t):Wt(void 0,t),function(l){var c=_.__N?_.__N[0]:_.__[0],i=_.t(c,l);c!==i&&(_.__N=[i,_.__[1]],_.__c.setState({}))}],_.__c=b,!b.__f)){var s=function(l,c,i){if(!_.__c.__H)return!0;var d=!1,p=_.__c.props!==l;if(_.__c.__H.__.some(function(u){if(u.__N){d=!0;var v=u.__[0];u.__=u.__N,u.__N=void 0,v!==u.__[0]&&(p=!0)}}),r){var o=r.call(this,l,c,i);return d?o||p:o}return!d||p};b.__f=!0;var r=b.shouldComponentUpdate,a=b.componentWillUpdate;b.componentWillUpdate=function(l,c,i){if(this.__e){var d=r;r=void 0,s(l,c,i),r=d}a&&a.call(this,l,c,i)},b.shouldComponentUpdate=s}return _.__N||_.__}function G(e,t){var n=at(D++,3);!k.__s&&Ft(n.__H,t)&&(n.__=e,n.u=t,b.__H.__h.push(n))}function Ut(e,t){var n=at(D++,7);return Ft(n.__H,t)&&(n.__=e(),n.__H=t,n.__h=e),n.__}function Yt(){for(var e;e=Lt.shift();){var t=e.__H;if(e.__P&&t)try{t.__h.some(z),t.__h.some(st),t.__h=[]}catch(n){t.__h=[],k.__e(n,e.__v)}}}k.__b=function(e){b=null,At&&At(e)},k.__=function(e,t){e&&t.__k&&t.__k.__m&&(e.__m=t.__k.__m),Tt&&Tt(e,t)},k.__r=function(e){Et&&Et(e),D=0;var t=(b=e.__c).__H;t&&(rt===b?(t.__h=[],b.__h=[],t.__.some(function(n){n.__N&&(n.__=n.__N),n.u=n.__N=void 0})):(t.__h.some(z),t.__h.some(st),t.__h=[],D=0)),rt=b},k.diffed=function(e){Nt&&Nt(e);var t=e.__c;t&&t.__H&&(t.__H.__h.length&&(Lt.push(t)!==1&&Pt===k.requestAnimationFrame||((Pt=k.requestAnimationFrame)||Zt)(Yt)),t.__H.__.some(function(n){n.u&&(n.__H=n.u,n.u=void 0)})),rt=b=null},k.__c=function(e,t){t.some(function(n){try{n.__h.some(z),n.__h=n.__h.filter(function(_){return!_.__||st(_)})}catch(_){t.some(function(s){s.__h&&(s.__h=[])}),t=[],k.__e(_,n.__v)}}),Ht&&Ht(e,t)},k.unmount=function(e){Mt&&Mt(e);var t,n=e.__c;n&&n.__H&&(n.__H.__.some(function(_){try{z(_)}catch(s){t=s}}),n.__H=void 0,t&&k.__e(t,n.__v))};var Dt=typeof requestAnimationFrame=="function";function Zt(e){var t,n=function(){clearTimeout(_),Dt&&cancelAnimationFrame(t),setTimeout(e)},_=setTimeout(n,35);Dt&&(t=requestAnimationFrame(n))}function z(e){var t=b,n=e.__c;typeof n=="function"&&(e.__c=void 0,n()),b=t}function st(e){var t=b;e.__c=e.__(),b=t}function Ft(e,t){return!e||e.length!==t.length||t.some(function(n,_){return n!==e[_]})}function Wt(e,t){return typeof t=="function"?t(e):t}var Ot=function(e,t,n,_){var s;t[0]=0;for(var r=1;r<t.length;r++){var a=t[r++],l=t[r]?(t[0]|=a?1:2,n[t[r++]]):t[++r];a===3?_[0]=l:a===4?_[1]=Object.assign(_[1]||{},l):a===5?(_[1]=_[1]||{})[t[++r]]=l:a===6?_[1][t[++r]]+=l+"":a?(s=e.apply(l,Ot(e,l,n,["",null])),_.push(s),l[0]?t[0]|=2:(t[r-2]=0,t[r]=s)):_.push(l)}return _},qt=new Map;function Rt(e){var t=qt.get(this);return t||(t=new Map,qt.set(this,t)),(t=Ot(this,t.get(e)||(t.set(e,t=function(n){for(var _,s,r=1,a="",l="",c=[0],i=function(o){r===1&&(o||(a=a.replace(/^\s*\n\s*|\s*\n\s*$/g,"")))?c.push(0,o,a):r===3&&(o||a)?(c.push(3,o,a),r=2):r===2&&a==="..."&&o?c.push(4,o,0):r===2&&a&&!o?c.push(5,0,!0,a):r>=5&&((a||!o&&r===5)&&(c.push(r,0,a,s),r=6),o&&(c.push(r,o,0,s),r=6)),a=""},d=0;d<n.length;d++){d&&(r===1&&i(),i(d));for(var p=0;p<n[d].length;p++)_=n[d][p],r===1?_==="<"?(i(),c=[c],r=3):a+=_:r===4?a==="--"&&_===">"?(r=1,a=""):a=_+a[0]:l?_===l?l="":a+=_:_==='"'||_==="'"?l=_:_===">"?(i(),r=1):r&&(_==="="?(r=5,s=a,a=""):_==="/"&&(r<5||n[d][p+1]===">")?(i(),r===3&&(c=c[0]),r=c,(c=c[0]).push(2,0,r),r=0):_===" "||_==="	"||_===`
`||_==="\r"?(i(),r=2):a+=_),r===3&&a==="!--"&&(r=4,c=c[0])}return i(),c}(e)),t),arguments,[])).length>1?t:t[0]}var $=Rt.bind(et),It={group_chat:{agent_ids:["IndustryExpertAgent","TechnicalAnalysisAgent","FundamentalAnalysisAgent"],query:"What stock should I buy?",option_label:"stocks"},handoff_workflow:{task:"Process refund for order #12345",steps:[{agent_id:"CustomerAgent"},{agent_id:"SellerAgent"},{agent_id:"PaymentAgent"},{agent_id:"NotificationAgent"}],context:{order_id:"12345"},failure_agent:"NotificationAgent"},collaborative_filtering:{agent_ids:["PriceAgent","QualityAgent","LocationAgent","ReviewsAgent"],weights:{price:.2,quality:.4,location:.3,reviews:.1},query:"Hotel in Paris near Eiffel Tower"},consensus:{problem:"Should we migrate to microservices?",wait_for_all_votes:!0},research:{query:"What is the latest lithium-ion battery recycling rate?"},route:{request_type:"stock_recommendation",query:"What stock should I buy?"},parallel:{patterns:[{name:"stocks",route:{request_type:"stock_recommendation",query:"Best stock?"}},{name:"hotels",route:{request_type:"hotel_recommendation",query:"Hotel in Paris"}}]}};async function lt(e){let t=await fetch(e);if(!t.ok)throw new Error(`${t.status} ${await t.text()}`);return t.json()}function L(e,t=2){return typeof e=="number"?e.toFixed(t):"\u2013"}function it({title:e,points:t,series:n,unit:_}){let l=t.flatMap(p=>n.map(o=>p[o.key]||0)),c=Math.max(1e-9,...l)*1.1,i=p=>t.map((o,u)=>{let v=28+u/Math.max(1,t.length-1)*426,f=140-28/2-(o[p]||0)/c*112;return`${u?"L":"M"}${v.toFixed(1)},${f.toFixed(1)}`}).join(" "),d=t[t.length-1]||{};return $`<figure class="chart" data-chart=${e}>
    <figcaption>
      ${e}
      ${n.map(p=>$`<span class="legend" style=${`color:${p.color}`}
          >${p.label} ${L(d[p.key])} ${_}</span
        >`)}
    </figcaption>
    <svg viewBox=${"0 0 460 140"} role="img" aria-label=${e}>
      <text x="2" y="12" class="axis">${L(c,1)}</text>
      <text x="2" y=${136} class="axis">0</text>
      ${n.map(p=>$`<path d=${i(p.key)} fill="none" stroke=${p.color} stroke-width="1.8" />`)}
    </svg>
  </figure>`}function te({agents:e}){return $`<section>
    <h2>Agents <small>${e.length}</small></h2>
    <table id="agents">
      <thead>
        <tr>
          <th>agent</th><th>types</th><th>health</th><th>HIGH</th><th>MEDIUM</th><th>LOW</th>
          <th>in flight</th><th>dead</th><th>address</th>
        </tr>
      </thead>
      <tbody>
        ${e.map(t=>$`<tr data-agent=${t.agent_id}>
            <td class="id">${t.agent_id}</td>
            <td>${t.agent_types.join(", ")}</td>
            <td class=${`health ${t.health}`}>${t.health}</td>
            <td>${t.high}</td><td>${t.medium}</td><td>${t.low}</td>
            <td>${t.in_flight}</td><td>${t.dead_letters}</td>
            <td class="addr">${t.address}</td>
          </tr>`)}
      </tbody>
    </table>
  </section>`}function ee({trace:e}){if(!e)return null;if(!e.spans.length)return $`<p class="note">${e.note||"no spans"}</p>`;let t=new Set(e.critical_path),n=Math.max(e.total_ms,1e-6);return $`<div class="waterfall" id="waterfall">
    <p>${e.spans.length} spans, ${L(e.total_ms)} ms; critical path highlighted</p>
    ${e.spans.map(_=>$`<div class=${`span ${t.has(_.span_id)?"critical":""}`}
        data-span=${_.span_id}>
        <span class="label" title=${_.service}>${_.name}</span>
        <span class="track">
          <span
            class="bar"
            style=${`left:${_.offset_ms/n*100}%;width:${Math.max(.4,_.duration_ms/n*100)}%`}
          ></span>
        </span>
        <span class="ms">${L(_.duration_ms)} ms</span>
      </div>`)}
  </div>`}function ne({run:e,events:t}){let[n,_]=x(null);return G(()=>_(null),[e.run_id]),$`<section id="run-detail" data-run=${e.run_id}>
    <h2>
      ${e.pattern} <code>${e.run_id}</code>
      <span class=${`status ${e.status}`}>${e.status}</span>
      <button
        id="show-trace"
        onClick=${async()=>_(await lt(`/api/traces/${e.run_id}`))}
      >
        Trace waterfall
      </button>
    </h2>
    <ol class="events">
      ${t.map(s=>$`<li class=${`event ${s.kind}`} data-kind=${s.kind}>
          <span class="kind">${s.kind}</span>
          ${s.agent_id&&$`<span class="agent">${s.agent_id}</span>`}
          <span class="summary">${s.summary}</span>
          <span class="ms">${L(s.elapsed_ms,1)} ms</span>
        </li>`)}
    </ol>
    <${ee} trace=${n} />
  </section>`}function _e({state:e,onStarted:t}){let[n,_]=x("group_chat"),[s,r]=x(JSON.stringify(It.group_chat,null,2)),[a,l]=x(""),[c,i]=x("");if(!e.allow_runs)return $`<section><p class="note">Read-only dashboard.</p></section>`;let d=o=>{_(o),r(JSON.stringify(It[o]||{},null,2))};return $`<section>
    <h2>Start a pattern</h2>
    <form id="start" onSubmit=${async o=>{o.preventDefault(),i("");let u;try{u=JSON.parse(s)}catch(m){i(`not JSON: ${m.message}`);return}let v={"Content-Type":"application/json"};a&&(v.Authorization=`Bearer ${a}`);let f=await fetch(`/api/patterns/${n}`,{method:"POST",headers:v,body:JSON.stringify(u)}),y=await f.text();if(!f.ok){try{i(JSON.parse(y).message||y)}catch{i(y)}return}t(JSON.parse(y).run_id)}}>
      <select id="pattern" value=${n} onChange=${o=>d(o.target.value)}>
        ${e.patterns.map(o=>$`<option value=${o}>${o}</option>`)}
      </select>
      ${e.credential_required&&$`<input
        id="token"
        type="password"
        placeholder="gateway credential"
        value=${a}
        onInput=${o=>l(o.target.value)}
      />`}
      <textarea id="body" rows="8" value=${s} onInput=${o=>r(o.target.value)} />
      <button id="run" type="submit">Start</button>
      ${c&&$`<p class="error" id="start-error">${c}</p>`}
    </form>
  </section>`}function re(){let[e,t]=x(null),n=async()=>t(await lt("/api/dead-letters"));return G(()=>{n()},[]),$`<section>
    <h2>Dead letters <button onClick=${n}>Refresh</button></h2>
    ${e&&(e.length?$`<table id="dead-letters">
          <thead><tr><th>message</th><th>from</th><th>to</th><th>reason</th><th>at</th></tr></thead>
          <tbody>
            ${e.map(_=>$`<tr>
                <td><code>${_.message_id}</code></td><td>${_.from_agent}</td>
                <td>${_.to_agent}</td><td>${_.reason}</td><td>${_.dead_lettered_at}</td>
              </tr>`)}
          </tbody>
        </table>`:$`<p class="note" id="dead-letters">none</p>`)}
  </section>`}function oe(){let[e,t]=x(null),[n,_]=x([]),[s,r]=x([]),[a,l]=x(null),[c,i]=x({}),[d,p]=x(!1);G(()=>{let f=new EventSource("/api/events");return f.addEventListener("open",()=>p(!0)),f.addEventListener("error",()=>p(!1)),f.addEventListener("state",y=>{let m=JSON.parse(y.data);t(m),_(m.history),r(m.runs)}),f.addEventListener("snapshot",y=>{let m=JSON.parse(y.data);t(h=>({...h,...m})),_(h=>[...h.slice(-299),m.point])}),f.addEventListener("event",y=>{let{run:m,event:h}=JSON.parse(y.data);r(w=>[m,...w.filter(A=>A.run_id!==m.run_id)].slice(0,50)),i(w=>({...w,[m.run_id]:[...w[m.run_id]||[],h]}))}),()=>f.close()},[]);let o=async f=>{l(f);try{let y=await lt(`/api/runs/${f}`);i(m=>{let h=m[f]||[];return{...m,[f]:y.events.length>=h.length?y.events:h}})}catch{}},u=Ut(()=>s.find(f=>f.run_id===a),[s,a]);if(!e)return $`<p class="note">connecting…</p>`;let v=e.totals||{};return $`<main>
    <header>
      <h1>agentmesh</h1>
      <span id="live" class=${d?"live":"offline"}>${d?"live":"offline"}</span>
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
          ${s.map(f=>$`<li
              class=${`run ${f.run_id===a?"selected":""}`}
              data-run=${f.run_id}
              onClick=${()=>o(f.run_id)}
            >
              <span class="pattern">${f.pattern}</span> <code>${f.run_id}</code>
              <span class=${`status ${f.status}`}>${f.status}</span>
            </li>`)}
        </ul>
      </section>
      <${_e} state=${e} onStarted=${o} />
    </div>
    ${u&&$`<${ne} run=${u} events=${c[u.run_id]||[]} />`}
    <${re} />
  </main>`}Ct($`<${oe} />`,document.getElementById("app"));
