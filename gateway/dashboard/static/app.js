var j,$,ve,je,A,pe,ge,ye,X,O,M,$e,Z,K,Y,Ve,I={},J=[],ze=/acit|ex(?:s|g|n|p|$)|rph|grid|ows|mnc|ntw|ine[ch]|zoo|^ord|itera/i,V=Array.isArray;function C(t,e){for(var n in e)t[n]=e[n];return t}function ee(t){t&&t.parentNode&&t.parentNode.removeChild(t)}function te(t,e,n){var r,s,_,a={};for(_ in e)_=="key"?r=e[_]:_=="ref"?s=e[_]:a[_]=e[_];if(arguments.length>2&&(a.children=arguments.length>3?j.call(arguments,2):n),typeof t=="function"&&t.defaultProps!=null)for(_ in t.defaultProps)a[_]===void 0&&(a[_]=t.defaultProps[_]);return W(t,a,r,s,null)}function W(t,e,n,r,s){var _={type:t,props:e,key:n,ref:r,__k:null,__:null,__b:0,__e:null,__c:null,constructor:void 0,__v:s??++ve,__i:-1,__u:0};return s==null&&$.vnode!=null&&$.vnode(_),_}function z(t){return t.children}function R(t,e){this.props=t,this.context=e}function N(t,e){if(e==null)return t.__?N(t.__,t.__i+1):null;for(var n;e<t.__k.length;e++)if((n=t.__k[e])!=null&&n.__e!=null)return n.__e;return typeof t.type=="function"?N(t):null}function Ge(t){if(t.__P&&t.__d){var e=t.__v,n=e.__e,r=[],s=[],_=C({},e);_.__v=e.__v+1,$.vnode&&$.vnode(_),ne(t.__P,_,e,t.__n,t.__P.namespaceURI,32&e.__u?[n]:null,r,n??N(e),!!(32&e.__u),s),_.__v=e.__v,_.__.__k[_.__i]=_,Se(r,_,s),e.__e=e.__=null,_.__e!=n&&be(_)}}function be(t){if((t=t.__)!=null&&t.__c!=null)return t.__e=t.__c.base=null,t.__k.some(function(e){if(e!=null&&e.__e!=null)return t.__e=t.__c.base=e.__e}),be(t)}function fe(t){(!t.__d&&(t.__d=!0)&&A.push(t)&&!B.__r++||pe!=$.debounceRendering)&&((pe=$.debounceRendering)||ge)(B)}function B(){try{for(var t,e=1;A.length;)A.length>e&&A.sort(ye),t=A.shift(),e=A.length,Ge(t)}finally{A.length=B.__r=0}}function ke(t,e,n,r,s,_,a,l,c,i,u){var p,o,d,v,f,y,g=r&&r.__k||J,h=e.length;for(c=Qe(n,e,g,c,h),p=0;p<h;p++)(d=n.__k[p])!=null&&(o=d.__i!=-1&&g[d.__i]||I,d.__i=p,y=ne(t,d,o,s,_,a,l,c,i,u),v=d.__e,d.ref&&o.ref!=d.ref&&(o.ref&&_e(o.ref,null,d),u.push(d.ref,d.__c||v,d)),f==null&&v!=null&&(f=v),4&d.__u?(c=we(d,c,t),o.__e&&(o.__e=null)):typeof d.type=="function"&&y!==void 0?c=y:v&&(c=v.nextSibling),d.__u&=-7);return n.__e=f,c}function Qe(t,e,n,r,s){var _,a,l,c,i,u=n.length,p=u,o=0;for(t.__k=new Array(s),_=0;_<s;_++)(a=e[_])!=null&&typeof a!="boolean"&&typeof a!="function"?(typeof a=="string"||typeof a=="number"||typeof a=="bigint"||a.constructor==String?a=t.__k[_]=W(null,a,null,null,null):V(a)?a=t.__k[_]=W(z,{children:a},null,null,null):a.constructor===void 0&&a.__b>0?a=t.__k[_]=W(a.type,a.props,a.key,a.ref?a.ref:null,a.__v):t.__k[_]=a,c=_+o,a.__=t,a.__b=t.__b+1,l=null,(i=a.__i=Xe(a,n,c,p))!=-1&&(p--,(l=n[i])&&(l.__u|=2)),l==null||l.__v==null?(i==-1&&(s>u?o--:s<u&&o++),typeof a.type!="function"&&(a.__u|=4)):i!=c&&(i==c-1?o--:i==c+1?o++:(i>c?o--:o++,a.__u|=4))):t.__k[_]=null;if(p)for(_=0;_<u;_++)(l=n[_])!=null&&!(2&l.__u)&&(l.__e==r&&(r=N(l)),Ae(l,l));return r}function we(t,e,n){var r,s;if(typeof t.type=="function"){for(r=t.__k,s=0;r&&s<r.length;s++)r[s]&&(r[s].__=t,e=we(r[s],e,n));return e}t.__e!=e&&(e&&t.type&&!e.parentNode&&(e=N(t)),e=n.insertBefore(t.__e,e||null));do e=e&&e.nextSibling;while(e!=null&&e.nodeType==8);return e}function Xe(t,e,n,r){var s,_,a,l=t.key,c=t.type,i=e[n],u=i!=null&&(2&i.__u)==0;if(i===null&&l==null||u&&l==i.key&&c==i.type)return n;if(r>(u?1:0)){for(s=n-1,_=n+1;s>=0||_<e.length;)if((i=e[a=s>=0?s--:_++])!=null&&!(2&i.__u)&&l==i.key&&c==i.type)return a}return-1}function he(t,e,n){e[0]=="-"?t.setProperty(e,n??""):t[e]=n==null?"":typeof n!="number"||ze.test(e)?n:n+"px"}function F(t,e,n,r,s){var _,a;e:if(e=="style")if(typeof n=="string")t.style.cssText=n;else{if(typeof r=="string"&&(t.style.cssText=r=""),r)for(e in r)n&&e in n||he(t.style,e,"");if(n)for(e in n)r&&n[e]==r[e]||he(t.style,e,n[e])}else if(e[0]=="o"&&e[1]=="n")_=e!=(e=e.replace($e,"$1")),a=e.toLowerCase(),e=a in t||e=="onFocusOut"||e=="onFocusIn"?a.slice(2):e.slice(2),t.l||(t.l={}),t.l[e+_]=n,n?r?n[M]=r[M]:(n[M]=Z,t.addEventListener(e,_?Y:K,_)):t.removeEventListener(e,_?Y:K,_);else{if(s=="http://www.w3.org/2000/svg")e=e.replace(/xlink(H|:h)/,"h").replace(/sName$/,"s");else if(e!="width"&&e!="height"&&e!="href"&&e!="list"&&e!="form"&&e!="tabIndex"&&e!="download"&&e!="rowSpan"&&e!="colSpan"&&e!="role"&&e!="popover"&&e in t)try{t[e]=n??"";break e}catch{}typeof n=="function"||(n==null||n===!1&&e[4]!="-"?t.removeAttribute(e):t.setAttribute(e,e=="popover"&&n==1?"":n))}}function me(t){return function(e){if(this.l){var n=this.l[e.type+t];if(e[O]==null)e[O]=Z++;else if(e[O]<n[M])return;return n($.event?$.event(e):e)}}}function ne(t,e,n,r,s,_,a,l,c,i){var u,p,o,d,v,f,y,g,h,x,P,E,T,de,U,Q,S=e.type;if(e.constructor!==void 0)return null;128&n.__u&&(c=!!(32&n.__u),_=[l=e.__e=n.__e]),(u=$.__b)&&u(e);e:if(typeof S=="function"){p=a.length;try{if(h=e.props,x=S.prototype&&S.prototype.render,P=(u=S.contextType)&&r[u.__c],E=u?P?P.props.value:u.__:r,n.__c?g=(o=e.__c=n.__c).__=o.__E:(x?e.__c=o=new S(h,E):(e.__c=o=new R(h,E),o.constructor=S,o.render=Ye),P&&P.sub(o),o.state||(o.state={}),o.__n=r,d=o.__d=!0,o.__h=[],o._sb=[]),x&&o.__s==null&&(o.__s=o.state),x&&S.getDerivedStateFromProps!=null&&(o.__s==o.state&&(o.__s=C({},o.__s)),C(o.__s,S.getDerivedStateFromProps(h,o.__s))),v=o.props,f=o.state,o.__v=e,d)x&&S.getDerivedStateFromProps==null&&o.componentWillMount!=null&&o.componentWillMount(),x&&o.componentDidMount!=null&&o.__h.push(o.componentDidMount);else{if(x&&S.getDerivedStateFromProps==null&&h!==v&&o.componentWillReceiveProps!=null&&o.componentWillReceiveProps(h,E),e.__v==n.__v||!o.__e&&o.shouldComponentUpdate!=null&&o.shouldComponentUpdate(h,o.__s,E)===!1){e.__v!=n.__v&&(o.props=h,o.state=o.__s,o.__d=!1),e.__e=n.__e,e.__k=n.__k,e.__k.some(function(q){q&&(q.__=e)}),J.push.apply(o.__h,o._sb),o._sb=[],o.__h.length&&a.push(o),l=N(n);break e}o.componentWillUpdate!=null&&o.componentWillUpdate(h,o.__s,E),x&&o.componentDidUpdate!=null&&o.__h.push(function(){o.componentDidUpdate(v,f,y)})}if(o.context=E,o.props=h,o.__P=t,o.__e=!1,T=$.__r,de=0,x)o.state=o.__s,o.__d=!1,T&&T(e),u=o.render(o.props,o.state,o.context),J.push.apply(o.__h,o._sb),o._sb=[];else do o.__d=!1,T&&T(e),u=o.render(o.props,o.state,o.context),o.state=o.__s;while(o.__d&&++de<25);o.state=o.__s,o.getChildContext!=null&&(r=C(C({},r),o.getChildContext())),x&&!d&&o.getSnapshotBeforeUpdate!=null&&(y=o.getSnapshotBeforeUpdate(v,f)),U=u!=null&&u.type===z&&u.key==null?Ce(u.props.children):u,l=ke(t,V(U)?U:[U],e,n,r,s,_,a,l,c,i),o.base=e.__e,e.__u&=-161,o.__h.length&&a.push(o),g&&(o.__E=o.__=null)}catch(q){if(a.length=p,e.__v=null,c||_!=null){if(q.then){for(e.__u|=c?160:128;l&&l.nodeType==8&&l.nextSibling;)l=l.nextSibling;_!=null&&(_[_.indexOf(l)]=null),e.__e=l}else if(_!=null)for(Q=_.length;Q--;)ee(_[Q])}else e.__e=n.__e;e.__k==null&&(e.__k=n.__k||[]),q.then||xe(e),$.__e(q,e,n)}}else _==null&&e.__v==n.__v?(e.__k=n.__k,e.__e=n.__e):l=e.__e=Ke(n.__e,e,n,r,s,_,a,c,i);return(u=$.diffed)&&u(e),128&e.__u?void 0:l}function xe(t){t&&(t.__c&&(t.__c.__e=!0),t.__k&&t.__k.some(xe))}function Se(t,e,n){for(var r=0;r<n.length;r++)_e(n[r],n[++r],n[++r]);$.__c&&$.__c(e,t),t.some(function(s){try{t=s.__h,s.__h=[],t.some(function(_){_.call(s)})}catch(_){$.__e(_,s.__v)}})}function Ce(t){return typeof t!="object"||t==null||t.__b>0?t:V(t)?t.map(Ce):t.constructor!==void 0?null:C({},t)}function Ke(t,e,n,r,s,_,a,l,c){var i,u,p,o,d,v,f,y=n.props||I,g=e.props,h=e.type;if(h=="svg"?s="http://www.w3.org/2000/svg":h=="math"?s="http://www.w3.org/1998/Math/MathML":s||(s="http://www.w3.org/1999/xhtml"),_!=null){for(i=0;i<_.length;i++)if((d=_[i])&&"setAttribute"in d==!!h&&(h?d.localName==h:d.nodeType==3)){t=d,_[i]=null;break}}if(t==null){if(h==null)return document.createTextNode(g);t=document.createElementNS(s,h,g.is&&g),l&&($.__m&&$.__m(e,_),l=!1),_=null}if(h==null)y===g||l&&t.data==g||(t.data=g);else{if(_=h=="textarea"&&g.defaultValue!=null?null:_&&j.call(t.childNodes),!l&&_!=null)for(y={},i=0;i<t.attributes.length;i++)y[(d=t.attributes[i]).name]=d.value;for(i in y)d=y[i],i=="dangerouslySetInnerHTML"?p=d:i=="children"||i in g||i=="value"&&"defaultValue"in g||i=="checked"&&"defaultChecked"in g||F(t,i,null,d,s);for(i in g)d=g[i],i=="children"?o=d:i=="dangerouslySetInnerHTML"?u=d:i=="value"?v=d:i=="checked"?f=d:l&&typeof d!="function"||y[i]===d||F(t,i,d,y[i],s);if(u)l||p&&(u.__html==p.__html||u.__html==t.innerHTML)||(t.innerHTML=u.__html),e.__k=[];else if(p&&(t.innerHTML=""),ke(e.type=="template"?t.content:t,V(o)?o:[o],e,n,r,h=="foreignObject"?"http://www.w3.org/1999/xhtml":s,_,a,_?_[0]:n.__k&&N(n,0),l,c),_!=null)for(i=_.length;i--;)ee(_[i]);l&&h!="textarea"||(i="value",h=="progress"&&v==null?t.removeAttribute("value"):v!=null&&(v!==t[i]||h=="progress"&&!v||h=="option"&&v!=y[i])&&F(t,i,v,y[i],s),i="checked",f!=null&&f!=t[i]&&F(t,i,f,y[i],s))}return t}function _e(t,e,n){try{if(typeof t=="function"){var r=typeof t.__u=="function";r&&t.__u(),r&&e==null||(t.__u=t(e))}else t.current=e}catch(s){$.__e(s,n)}}function Ae(t,e,n){var r,s;if($.unmount&&$.unmount(t),(r=t.ref)&&(r.current&&r.current!=t.__e||_e(r,null,e)),(r=t.__c)!=null){if(r.componentWillUnmount)try{r.componentWillUnmount()}catch(_){$.__e(_,e)}r.base=r.__P=r.__n=null}if(r=t.__k)for(s=0;s<r.length;s++)r[s]&&Ae(r[s],e,n||typeof t.type!="function");n||ee(t.__e),t.__c=t.__=t.__e=void 0}function Ye(t,e,n){return this.constructor(t,n)}function Pe(t,e,n){var r,s,_,a;e==document&&(e=document.documentElement),$.__&&$.__(t,e),s=(r=typeof n=="function")?null:n&&n.__k||e.__k,_=[],a=[],ne(e,t=(!r&&n||e).__k=te(z,null,[t]),s||I,I,e.namespaceURI,!r&&n?[n]:s?null:e.firstChild?j.call(e.childNodes):null,_,!r&&n?n:s?s.__e:e.firstChild,r,a),Se(_,t,a),t.props.children=null}j=J.slice,$={__e:function(t,e,n,r){for(var s,_,a;e=e.__;)if((s=e.__c)&&!s.__)try{if((_=s.constructor)&&_.getDerivedStateFromError!=null&&(s.setState(_.getDerivedStateFromError(t)),a=s.__d),s.componentDidCatch!=null&&(s.componentDidCatch(t,r||{}),a=s.__d),a)return s.__E=s}catch(l){t=l}throw t}},ve=0,je=function(t){return t!=null&&t.constructor===void 0},R.prototype.setState=function(t,e){var n;n=this.__s!=null&&this.__s!=this.state?this.__s:this.__s=C({},this.state),typeof t=="function"&&(t=t(C({},n),this.props)),t&&C(n,t),t!=null&&this.__v&&(e&&this._sb.push(e),fe(this))},R.prototype.forceUpdate=function(t){this.__v&&(this.__e=!0,t&&this.__h.push(t),fe(this))},R.prototype.render=z,A=[],ge=typeof Promise=="function"?Promise.prototype.then.bind(Promise.resolve()):setTimeout,ye=function(t,e){return t.__v.__b-e.__v.__b},B.__r=0,X=Math.random().toString(8),O="__d"+X,M="__a"+X,$e=/(PointerCapture)$|Capture$/i,Z=0,K=me(!1),Y=me(!0),Ve=0;var D,b,re,Ee,oe=0,Ue=[],k=$,Ne=k.__b,qe=k.__r,He=k.diffed,Te=k.__c,Me=k.unmount,De=k.__;function ae(t,e){k.__h&&k.__h(b,t,oe||e),oe=0;var n=b.__H||(b.__H={__:[],__h:[]});return t>=n.__.length&&n.__.push({}),n.__[t]}function w(t){return oe=1,Ze(We,t)}function Ze(t,e,n){var r=ae(D++,2);if(r.t=t,!r.__c&&(r.__=[n?n(e):We(void 0,e),function(l){var c=r.__N?r.__N[0]:r.__[0],i=r.t(c,l);c!==i&&(r.__N=[i,r.__[1]],r.__c.setState({}))}],r.__c=b,!b.__f)){var s=function(l,c,i){if(!r.__c.__H)return!0;var u=!1,p=r.__c.props!==l;if(r.__c.__H.__.some(function(d){if(d.__N){u=!0;var v=d.__[0];d.__=d.__N,d.__N=void 0,v!==d.__[0]&&(p=!0)}}),_){var o=_.call(this,l,c,i);return u?o||p:o}return!u||p};b.__f=!0;var _=b.shouldComponentUpdate,a=b.componentWillUpdate;b.componentWillUpdate=function(l,c,i){if(this.__e){var u=_;_=void 0,s(l,c,i),_=u}a&&a.call(this,l,c,i)},b.shouldComponentUpdate=s}return r.__N||r.__}function L(t,e){var n=ae(D++,3);!k.__s&&Oe(n.__H,e)&&(n.__=t,n.u=e,b.__H.__h.push(n))}function Fe(t,e){var n=ae(D++,7);return Oe(n.__H,e)&&(n.__=t(),n.__H=e,n.__h=t),n.__}function et(){for(var t;t=Ue.shift();){var e=t.__H;if(t.__P&&e)try{e.__h.some(G),e.__h.some(se),e.__h=[]}catch(n){e.__h=[],k.__e(n,t.__v)}}}k.__b=function(t){b=null,Ne&&Ne(t)},k.__=function(t,e){t&&e.__k&&e.__k.__m&&(t.__m=e.__k.__m),De&&De(t,e)},k.__r=function(t){qe&&qe(t),D=0;var e=(b=t.__c).__H;e&&(re===b?(e.__h=[],b.__h=[],e.__.some(function(n){n.__N&&(n.__=n.__N),n.u=n.__N=void 0})):(e.__h.some(G),e.__h.some(se),e.__h=[],D=0)),re=b},k.diffed=function(t){He&&He(t);var e=t.__c;e&&e.__H&&(e.__H.__h.length&&(Ue.push(e)!==1&&Ee===k.requestAnimationFrame||((Ee=k.requestAnimationFrame)||tt)(et)),e.__H.__.some(function(n){n.u&&(n.__H=n.u,n.u=void 0)})),re=b=null},k.__c=function(t,e){e.some(function(n){try{n.__h.some(G),n.__h=n.__h.filter(function(r){return!r.__||se(r)})}catch(r){e.some(function(s){s.__h&&(s.__h=[])}),e=[],k.__e(r,n.__v)}}),Te&&Te(t,e)},k.unmount=function(t){Me&&Me(t);var e,n=t.__c;n&&n.__H&&(n.__H.__.some(function(r){try{G(r)}catch(s){e=s}}),n.__H=void 0,e&&k.__e(e,n.__v))};var Le=typeof requestAnimationFrame=="function";function tt(t){var e,n=function(){clearTimeout(r),Le&&cancelAnimationFrame(e),setTimeout(t)},r=setTimeout(n,35);Le&&(e=requestAnimationFrame(n))}function G(t){var e=b,n=t.__c;typeof n=="function"&&(t.__c=void 0,n()),b=e}function se(t){var e=b;t.__c=t.__(),b=e}function Oe(t,e){return!t||t.length!==e.length||e.some(function(n,r){return n!==t[r]})}function We(t,e){return typeof e=="function"?e(t):e}var Ie=function(t,e,n,r){var s;e[0]=0;for(var _=1;_<e.length;_++){var a=e[_++],l=e[_]?(e[0]|=a?1:2,n[e[_++]]):e[++_];a===3?r[0]=l:a===4?r[1]=Object.assign(r[1]||{},l):a===5?(r[1]=r[1]||{})[e[++_]]=l:a===6?r[1][e[++_]]+=l+"":a?(s=t.apply(l,Ie(t,l,n,["",null])),r.push(s),l[0]?e[0]|=2:(e[_-2]=0,e[_]=s)):r.push(l)}return r},Re=new Map;function Je(t){var e=Re.get(this);return e||(e=new Map,Re.set(this,e)),(e=Ie(this,e.get(t)||(e.set(t,e=function(n){for(var r,s,_=1,a="",l="",c=[0],i=function(o){_===1&&(o||(a=a.replace(/^\s*\n\s*|\s*\n\s*$/g,"")))?c.push(0,o,a):_===3&&(o||a)?(c.push(3,o,a),_=2):_===2&&a==="..."&&o?c.push(4,o,0):_===2&&a&&!o?c.push(5,0,!0,a):_>=5&&((a||!o&&_===5)&&(c.push(_,0,a,s),_=6),o&&(c.push(_,o,0,s),_=6)),a=""},u=0;u<n.length;u++){u&&(_===1&&i(),i(u));for(var p=0;p<n[u].length;p++)r=n[u][p],_===1?r==="<"?(i(),c=[c],_=3):a+=r:_===4?a==="--"&&r===">"?(_=1,a=""):a=r+a[0]:l?r===l?l="":a+=r:r==='"'||r==="'"?l=r:r===">"?(i(),_=1):_&&(r==="="?(_=5,s=a,a=""):r==="/"&&(_<5||n[u][p+1]===">")?(i(),_===3&&(c=c[0]),_=c,(c=c[0]).push(2,0,_),_=0):r===" "||r==="	"||r===`
`||r==="\r"?(i(),_=2):a+=r),_===3&&a==="!--"&&(_=4,c=c[0])}return i(),c}(t)),e),arguments,[])).length>1?e:e[0]}var m=Je.bind(te),Be={group_chat:{agent_ids:["IndustryExpertAgent","TechnicalAnalysisAgent","FundamentalAnalysisAgent"],query:"What stock should I buy?",option_label:"stocks"},handoff_workflow:{task:"Process refund for order #12345",steps:[{agent_id:"CustomerAgent"},{agent_id:"SellerAgent"},{agent_id:"PaymentAgent"},{agent_id:"NotificationAgent"}],context:{order_id:"12345"},failure_agent:"NotificationAgent"},collaborative_filtering:{agent_ids:["PriceAgent","QualityAgent","LocationAgent","ReviewsAgent"],weights:{price:.2,quality:.4,location:.3,reviews:.1},query:"Hotel in Paris near Eiffel Tower"},consensus:{problem:"Should we migrate to microservices?",wait_for_all_votes:!0},research:{query:"What is the latest lithium-ion battery recycling rate?"},route:{request_type:"stock_recommendation",query:"What stock should I buy?"},parallel:{patterns:[{name:"stocks",route:{request_type:"stock_recommendation",query:"Best stock?"}},{name:"hotels",route:{request_type:"hotel_recommendation",query:"Hotel in Paris"}}]}};async function le(t){let e=await fetch(t);if(!e.ok)throw new Error(`${e.status} ${await e.text()}`);return e.json()}async function ue(t,e,n){let r={"Content-Type":"application/json"};n&&(r.Authorization=`Bearer ${n}`);let s,_;try{s=await fetch(t,{method:"POST",headers:r,body:JSON.stringify(e)}),_=await s.text()}catch(a){return{ok:!1,message:`the dashboard could not be reached: ${a.message}`}}try{let a=JSON.parse(_);return s.ok?{ok:!0,...a}:{ok:!1,message:a.message||_}}catch{return{ok:!1,message:_}}}function ce({id:t,token:e,set:n}){return m`<input
    id=${t}
    type="password"
    placeholder="gateway credential"
    value=${e}
    onInput=${r=>n(r.target.value)}
  />`}function H(t,e=2){return typeof t=="number"?t.toFixed(e):"\u2013"}function ie({title:t,points:e,series:n,unit:r}){let l=e.flatMap(p=>n.map(o=>p[o.key]||0)),c=Math.max(1e-9,...l)*1.1,i=p=>e.map((o,d)=>{let v=28+d/Math.max(1,e.length-1)*426,f=140-28/2-(o[p]||0)/c*112;return`${d?"L":"M"}${v.toFixed(1)},${f.toFixed(1)}`}).join(" "),u=e[e.length-1]||{};return m`<figure class="chart" data-chart=${t}>
    <figcaption>
      ${t}
      ${n.map(p=>m`<span class="legend" style=${`color:${p.color}`}
          >${p.label} ${H(u[p.key])} ${r}</span
        >`)}
    </figcaption>
    <svg viewBox=${"0 0 460 140"} role="img" aria-label=${t}>
      <text x="2" y="12" class="axis">${H(c,1)}</text>
      <text x="2" y=${136} class="axis">0</text>
      ${n.map(p=>m`<path d=${i(p.key)} fill="none" stroke=${p.color} stroke-width="1.8" />`)}
    </svg>
  </figure>`}function nt({agents:t}){return m`<section>
    <h2>Agents <small>${t.length}</small></h2>
    <table id="agents">
      <thead>
        <tr>
          <th>agent</th><th>types</th><th>health</th><th>HIGH</th><th>MEDIUM</th><th>LOW</th>
          <th>in flight</th><th>dead</th><th>address</th>
        </tr>
      </thead>
      <tbody>
        ${t.map(e=>m`<tr data-agent=${e.agent_id}>
            <td class="id">${e.agent_id}</td>
            <td>${e.agent_types.join(", ")}</td>
            <td class=${`health ${e.health}`}>${e.health}</td>
            <td>${e.high}</td><td>${e.medium}</td><td>${e.low}</td>
            <td>${e.in_flight}</td><td>${e.dead_letters}</td>
            <td class="addr">${e.address}</td>
          </tr>`)}
      </tbody>
    </table>
  </section>`}function _t({trace:t}){if(!t)return null;if(!t.spans.length)return m`<p class="note">${t.note||"no spans"}</p>`;let e=new Set(t.critical_path),n=Math.max(t.total_ms,1e-6);return m`<div class="waterfall" id="waterfall">
    <p>${t.spans.length} spans, ${H(t.total_ms)} ms; critical path highlighted</p>
    ${t.spans.map(r=>m`<div class=${`span ${e.has(r.span_id)?"critical":""}`}
        data-span=${r.span_id}>
        <span class="label" title=${r.service}>${r.name}</span>
        <span class="track">
          <span
            class="bar"
            style=${`left:${r.offset_ms/n*100}%;width:${Math.max(.4,r.duration_ms/n*100)}%`}
          ></span>
        </span>
        <span class="ms">${H(r.duration_ms)} ms</span>
      </div>`)}
  </div>`}function rt(t,e){let n=H(e.accuracy*100,0);return`${t} accuracy ${n}% (${e.satisfied} of ${e.rated} rated runs)`}function ot({run:t,state:e}){let[n,r]=w(""),[s,_]=w(null);if(L(()=>_(null),[t.run_id]),!e.allow_runs||!["COMPLETED","PARTIAL"].includes(t.status))return null;let a=async l=>_(await ue(`/api/runs/${t.run_id}/feedback`,{satisfied:l},n));return m`<p id="feedback">
    Did this outcome satisfy you?
    ${e.credential_required&&m`<${ce} id="feedback-token" token=${n} set=${r} />`}
    <button id="satisfied" onClick=${()=>a(!0)}>Yes</button>
    <button id="not-satisfied" onClick=${()=>a(!1)}>No</button>
    ${s&&(s.ok?m`<span id="accuracy">${rt(t.pattern,s)}</span>`:m`<span class="error" id="feedback-error">${s.message}</span>`)}
  </p>`}function st({run:t,events:e,state:n}){let[r,s]=w(null);return L(()=>s(null),[t.run_id]),m`<section id="run-detail" data-run=${t.run_id}>
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
      ${e.map(_=>m`<li class=${`event ${_.kind}`} data-kind=${_.kind}>
          <span class="kind">${_.kind}</span>
          ${_.agent_id&&m`<span class="agent">${_.agent_id}</span>`}
          <span class="summary">${_.summary}</span>
          <span class="ms">${H(_.elapsed_ms,1)} ms</span>
        </li>`)}
    </ol>
    <${ot} run=${t} state=${n} />
    <${_t} trace=${r} />
  </section>`}function at({state:t,onStarted:e}){let[n,r]=w("group_chat"),[s,_]=w(JSON.stringify(Be.group_chat,null,2)),[a,l]=w(""),[c,i]=w("");if(!t.allow_runs)return m`<section><p class="note">Read-only dashboard.</p></section>`;let u=o=>{r(o),_(JSON.stringify(Be[o]||{},null,2))};return m`<section>
    <h2>Start a pattern</h2>
    <form id="start" onSubmit=${async o=>{o.preventDefault(),i("");let d;try{d=JSON.parse(s)}catch(f){i(`not JSON: ${f.message}`);return}let v=await ue(`/api/patterns/${n}`,d,a);if(!v.ok){i(v.message);return}e(v.run_id)}}>
      <select id="pattern" value=${n} onChange=${o=>u(o.target.value)}>
        ${t.patterns.map(o=>m`<option value=${o}>${o}</option>`)}
      </select>
      ${t.credential_required&&m`<${ce} id="token" token=${a} set=${l} />`}
      <textarea id="body" rows="8" value=${s} onInput=${o=>_(o.target.value)} />
      <button id="run" type="submit">Start</button>
      ${c&&m`<p class="error" id="start-error">${c}</p>`}
    </form>
  </section>`}function it({state:t}){let[e,n]=w(null),[r,s]=w(""),[_,a]=w(null),l=async()=>n(await le("/api/dead-letters"));L(()=>{l()},[]);let c=async u=>{let p={agent_id:u.to_agent,message_ids:[u.message_id]};a(await ue("/api/dead-letters/requeue",p,r)),await l()},i=t.allow_runs;return m`<section>
    <h2>Dead letters <button onClick=${l}>Refresh</button></h2>
    ${i&&t.credential_required&&m`<${ce} id="requeue-token" token=${r} set=${s} />`}
    ${_&&(_.ok?m`<p id="requeue-result">
          ${_.requeued} requeued${_.left?`, ${_.left} left (queue full)`:""}
        </p>`:m`<p class="error" id="requeue-result">${_.message}</p>`)}
    ${e&&(e.length?m`<table id="dead-letters">
          <thead>
            <tr>
              <th>message</th><th>from</th><th>to</th><th>reason</th><th>at</th>
              ${i&&m`<th></th>`}
            </tr>
          </thead>
          <tbody>
            ${e.map(u=>m`<tr>
                <td><code>${u.message_id}</code></td><td>${u.from_agent}</td>
                <td>${u.to_agent}</td><td>${u.reason}</td><td>${u.dead_lettered_at}</td>
                ${i&&m`<td>
                  <button class="requeue" data-message=${u.message_id} onClick=${()=>c(u)}>
                    Requeue
                  </button>
                </td>`}
              </tr>`)}
          </tbody>
        </table>`:m`<p class="note" id="dead-letters">none</p>`)}
  </section>`}function lt(){let[t,e]=w(null),[n,r]=w([]),[s,_]=w([]),[a,l]=w(null),[c,i]=w({}),[u,p]=w(!1);L(()=>{let f=new EventSource("/api/events");return f.addEventListener("open",()=>p(!0)),f.addEventListener("error",()=>p(!1)),f.addEventListener("state",y=>{let g=JSON.parse(y.data);e(g),r(g.history),_(g.runs)}),f.addEventListener("snapshot",y=>{let g=JSON.parse(y.data);e(h=>({...h,...g})),r(h=>[...h.slice(-299),g.point])}),f.addEventListener("event",y=>{let{run:g,event:h}=JSON.parse(y.data);_(x=>[g,...x.filter(P=>P.run_id!==g.run_id)].slice(0,50)),i(x=>({...x,[g.run_id]:[...x[g.run_id]||[],h]}))}),()=>f.close()},[]);let o=async f=>{l(f);try{let y=await le(`/api/runs/${f}`);i(g=>{let h=g[f]||[];return{...g,[f]:y.events.length>=h.length?y.events:h}})}catch{}},d=Fe(()=>s.find(f=>f.run_id===a),[s,a]);if(!t)return m`<p class="note">connecting…</p>`;let v=t.totals||{};return m`<main>
    <header>
      <h1>agentmesh</h1>
      <span id="live" class=${u?"live":"offline"}>${u?"live":"offline"}</span>
      <span>held <b>${v.held}</b></span>
      <span>sent <b>${v.sent_count}</b></span>
      <span>delivered <b>${v.delivered_count}</b></span>
      <span>expired <b>${v.expired_count}</b></span>
      <span>dead <b>${v.dead_lettered_count}</b></span>
      <span title="requests whose requester gave up">withdrawn <b>${v.withdrawn_count}</b></span>
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
    <${nt} agents=${t.agents||[]} />
    <div class="columns">
      <section>
        <h2>Pattern runs</h2>
        <ul id="runs">
          ${s.map(f=>m`<li
              class=${`run ${f.run_id===a?"selected":""}`}
              data-run=${f.run_id}
              onClick=${()=>o(f.run_id)}
            >
              <span class="pattern">${f.pattern}</span> <code>${f.run_id}</code>
              <span class=${`status ${f.status}`}>${f.status}</span>
            </li>`)}
        </ul>
      </section>
      <${at} state=${t} onStarted=${o} />
    </div>
    ${d&&m`<${st} run=${d} events=${c[d.run_id]||[]} state=${t} />`}
    <${it} state=${t} />
  </main>`}Pe(m`<${lt} />`,document.getElementById("app"));
