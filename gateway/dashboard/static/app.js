var V,y,vt,jt,N,pt,gt,yt,K,W,M,$t,tt,Y,Z,Vt,J={},B=[],zt=/acit|ex(?:s|g|n|p|$)|rph|grid|ows|mnc|ntw|ine[ch]|zoo|^ord|itera/i,z=Array.isArray;function E(e,t){for(var n in t)e[n]=t[n];return e}function et(e){e&&e.parentNode&&e.parentNode.removeChild(e)}function nt(e,t,n){var r,s,o,a={};for(o in t)o=="key"?r=t[o]:o=="ref"?s=t[o]:a[o]=t[o];if(arguments.length>2&&(a.children=arguments.length>3?V.call(arguments,2):n),typeof e=="function"&&e.defaultProps!=null)for(o in e.defaultProps)a[o]===void 0&&(a[o]=e.defaultProps[o]);return R(e,a,r,s,null)}function R(e,t,n,r,s){var o={type:e,props:t,key:n,ref:r,__k:null,__:null,__b:0,__e:null,__c:null,constructor:void 0,__v:s??++vt,__i:-1,__u:0};return s==null&&y.vnode!=null&&y.vnode(o),o}function G(e){return e.children}function I(e,t){this.props=e,this.context=t}function H(e,t){if(t==null)return e.__?H(e.__,e.__i+1):null;for(var n;t<e.__k.length;t++)if((n=e.__k[t])!=null&&n.__e!=null)return n.__e;return typeof e.type=="function"?H(e):null}function Gt(e){if(e.__P&&e.__d){var t=e.__v,n=t.__e,r=[],s=[],o=E({},t);o.__v=t.__v+1,y.vnode&&y.vnode(o),ot(e.__P,o,t,e.__n,e.__P.namespaceURI,32&t.__u?[n]:null,r,n??H(t),!!(32&t.__u),s),o.__v=t.__v,o.__.__k[o.__i]=o,St(r,o,s),t.__e=t.__=null,o.__e!=n&&kt(o)}}function kt(e){if((e=e.__)!=null&&e.__c!=null)return e.__e=e.__c.base=null,e.__k.some(function(t){if(t!=null&&t.__e!=null)return e.__e=e.__c.base=t.__e}),kt(e)}function ft(e){(!e.__d&&(e.__d=!0)&&N.push(e)&&!j.__r++||pt!=y.debounceRendering)&&((pt=y.debounceRendering)||gt)(j)}function j(){try{for(var e,t=1;N.length;)N.length>t&&N.sort(yt),e=N.shift(),t=N.length,Gt(e)}finally{N.length=j.__r=0}}function bt(e,t,n,r,s,o,a,l,u,i,c){var p,_,d,v,b,$,f=r&&r.__k||B,h=t.length;for(u=Qt(n,t,f,u,h),p=0;p<h;p++)(d=n.__k[p])!=null&&(_=d.__i!=-1&&f[d.__i]||J,d.__i=p,$=ot(e,d,_,s,o,a,l,u,i,c),v=d.__e,d.ref&&_.ref!=d.ref&&(_.ref&&rt(_.ref,null,d),c.push(d.ref,d.__c||v,d)),b==null&&v!=null&&(b=v),4&d.__u?(u=wt(d,u,e),_.__e&&(_.__e=null)):typeof d.type=="function"&&$!==void 0?u=$:v&&(u=v.nextSibling),d.__u&=-7);return n.__e=b,u}function Qt(e,t,n,r,s){var o,a,l,u,i,c=n.length,p=c,_=0;for(e.__k=new Array(s),o=0;o<s;o++)(a=t[o])!=null&&typeof a!="boolean"&&typeof a!="function"?(typeof a=="string"||typeof a=="number"||typeof a=="bigint"||a.constructor==String?a=e.__k[o]=R(null,a,null,null,null):z(a)?a=e.__k[o]=R(G,{children:a},null,null,null):a.constructor===void 0&&a.__b>0?a=e.__k[o]=R(a.type,a.props,a.key,a.ref?a.ref:null,a.__v):e.__k[o]=a,u=o+_,a.__=e,a.__b=e.__b+1,l=null,(i=a.__i=Xt(a,n,u,p))!=-1&&(p--,(l=n[i])&&(l.__u|=2)),l==null||l.__v==null?(i==-1&&(s>c?_--:s<c&&_++),typeof a.type!="function"&&(a.__u|=4)):i!=u&&(i==u-1?_--:i==u+1?_++:(i>u?_--:_++,a.__u|=4))):e.__k[o]=null;if(p)for(o=0;o<c;o++)(l=n[o])!=null&&!(2&l.__u)&&(l.__e==r&&(r=H(l)),At(l,l));return r}function wt(e,t,n){var r,s;if(typeof e.type=="function"){for(r=e.__k,s=0;r&&s<r.length;s++)r[s]&&(r[s].__=e,t=wt(r[s],t,n));return t}e.__e!=t&&(t&&e.type&&!t.parentNode&&(t=H(e)),t=n.insertBefore(e.__e,t||null));do t=t&&t.nextSibling;while(t!=null&&t.nodeType==8);return t}function Xt(e,t,n,r){var s,o,a,l=e.key,u=e.type,i=t[n],c=i!=null&&(2&i.__u)==0;if(i===null&&l==null||c&&l==i.key&&u==i.type)return n;if(r>(c?1:0)){for(s=n-1,o=n+1;s>=0||o<t.length;)if((i=t[a=s>=0?s--:o++])!=null&&!(2&i.__u)&&l==i.key&&u==i.type)return a}return-1}function ht(e,t,n){t[0]=="-"?e.setProperty(t,n??""):e[t]=n==null?"":typeof n!="number"||zt.test(t)?n:n+"px"}function O(e,t,n,r,s){var o,a;t:if(t=="style")if(typeof n=="string")e.style.cssText=n;else{if(typeof r=="string"&&(e.style.cssText=r=""),r)for(t in r)n&&t in n||ht(e.style,t,"");if(n)for(t in n)r&&n[t]==r[t]||ht(e.style,t,n[t])}else if(t[0]=="o"&&t[1]=="n")o=t!=(t=t.replace($t,"$1")),a=t.toLowerCase(),t=a in e||t=="onFocusOut"||t=="onFocusIn"?a.slice(2):t.slice(2),e.l||(e.l={}),e.l[t+o]=n,n?r?n[M]=r[M]:(n[M]=tt,e.addEventListener(t,o?Z:Y,o)):e.removeEventListener(t,o?Z:Y,o);else{if(s=="http://www.w3.org/2000/svg")t=t.replace(/xlink(H|:h)/,"h").replace(/sName$/,"s");else if(t!="width"&&t!="height"&&t!="href"&&t!="list"&&t!="form"&&t!="tabIndex"&&t!="download"&&t!="rowSpan"&&t!="colSpan"&&t!="role"&&t!="popover"&&t in e)try{e[t]=n??"";break t}catch{}typeof n=="function"||(n==null||n===!1&&t[4]!="-"?e.removeAttribute(t):e.setAttribute(t,t=="popover"&&n==1?"":n))}}function mt(e){return function(t){if(this.l){var n=this.l[t.type+e];if(t[W]==null)t[W]=tt++;else if(t[W]<n[M])return;return n(y.event?y.event(t):t)}}}function ot(e,t,n,r,s,o,a,l,u,i){var c,p,_,d,v,b,$,f,h,g,S,C,A,U,F,X,P=t.type;if(t.constructor!==void 0)return null;128&n.__u&&(u=!!(32&n.__u),o=[l=t.__e=n.__e]),(c=y.__b)&&c(t);t:if(typeof P=="function"){p=a.length;try{if(h=t.props,g=P.prototype&&P.prototype.render,S=(c=P.contextType)&&r[c.__c],C=c?S?S.props.value:c.__:r,n.__c?f=(_=t.__c=n.__c).__=_.__E:(g?t.__c=_=new P(h,C):(t.__c=_=new I(h,C),_.constructor=P,_.render=Yt),S&&S.sub(_),_.state||(_.state={}),_.__n=r,d=_.__d=!0,_.__h=[],_._sb=[]),g&&_.__s==null&&(_.__s=_.state),g&&P.getDerivedStateFromProps!=null&&(_.__s==_.state&&(_.__s=E({},_.__s)),E(_.__s,P.getDerivedStateFromProps(h,_.__s))),v=_.props,b=_.state,_.__v=t,d)g&&P.getDerivedStateFromProps==null&&_.componentWillMount!=null&&_.componentWillMount(),g&&_.componentDidMount!=null&&_.__h.push(_.componentDidMount);else{if(g&&P.getDerivedStateFromProps==null&&h!==v&&_.componentWillReceiveProps!=null&&_.componentWillReceiveProps(h,C),t.__v==n.__v||!_.__e&&_.shouldComponentUpdate!=null&&_.shouldComponentUpdate(h,_.__s,C)===!1){t.__v!=n.__v&&(_.props=h,_.state=_.__s,_.__d=!1),t.__e=n.__e,t.__k=n.__k,t.__k.some(function(q){q&&(q.__=t)}),B.push.apply(_.__h,_._sb),_._sb=[],_.__h.length&&a.push(_),l=H(n);break t}_.componentWillUpdate!=null&&_.componentWillUpdate(h,_.__s,C),g&&_.componentDidUpdate!=null&&_.__h.push(function(){_.componentDidUpdate(v,b,$)})}if(_.context=C,_.props=h,_.__P=e,_.__e=!1,A=y.__r,U=0,g)_.state=_.__s,_.__d=!1,A&&A(t),c=_.render(_.props,_.state,_.context),B.push.apply(_.__h,_._sb),_._sb=[];else do _.__d=!1,A&&A(t),c=_.render(_.props,_.state,_.context),_.state=_.__s;while(_.__d&&++U<25);_.state=_.__s,_.getChildContext!=null&&(r=E(E({},r),_.getChildContext())),g&&!d&&_.getSnapshotBeforeUpdate!=null&&($=_.getSnapshotBeforeUpdate(v,b)),F=c!=null&&c.type===G&&c.key==null?Ct(c.props.children):c,l=bt(e,z(F)?F:[F],t,n,r,s,o,a,l,u,i),_.base=t.__e,t.__u&=-161,_.__h.length&&a.push(_),f&&(_.__E=_.__=null)}catch(q){if(a.length=p,t.__v=null,u||o!=null){if(q.then){for(t.__u|=u?160:128;l&&l.nodeType==8&&l.nextSibling;)l=l.nextSibling;o!=null&&(o[o.indexOf(l)]=null),t.__e=l}else if(o!=null)for(X=o.length;X--;)et(o[X])}else t.__e=n.__e;t.__k==null&&(t.__k=n.__k||[]),q.then||xt(t),y.__e(q,t,n)}}else o==null&&t.__v==n.__v?(t.__k=n.__k,t.__e=n.__e):l=t.__e=Kt(n.__e,t,n,r,s,o,a,u,i);return(c=y.diffed)&&c(t),128&t.__u?void 0:l}function xt(e){e&&(e.__c&&(e.__c.__e=!0),e.__k&&e.__k.some(xt))}function St(e,t,n){for(var r=0;r<n.length;r++)rt(n[r],n[++r],n[++r]);y.__c&&y.__c(t,e),e.some(function(s){try{e=s.__h,s.__h=[],e.some(function(o){o.call(s)})}catch(o){y.__e(o,s.__v)}})}function Ct(e){return typeof e!="object"||e==null||e.__b>0?e:z(e)?e.map(Ct):e.constructor!==void 0?null:E({},e)}function Kt(e,t,n,r,s,o,a,l,u){var i,c,p,_,d,v,b,$=n.props||J,f=t.props,h=t.type;if(h=="svg"?s="http://www.w3.org/2000/svg":h=="math"?s="http://www.w3.org/1998/Math/MathML":s||(s="http://www.w3.org/1999/xhtml"),o!=null){for(i=0;i<o.length;i++)if((d=o[i])&&"setAttribute"in d==!!h&&(h?d.localName==h:d.nodeType==3)){e=d,o[i]=null;break}}if(e==null){if(h==null)return document.createTextNode(f);e=document.createElementNS(s,h,f.is&&f),l&&(y.__m&&y.__m(t,o),l=!1),o=null}if(h==null)$===f||l&&e.data==f||(e.data=f);else{if(o=h=="textarea"&&f.defaultValue!=null?null:o&&V.call(e.childNodes),!l&&o!=null)for($={},i=0;i<e.attributes.length;i++)$[(d=e.attributes[i]).name]=d.value;for(i in $)d=$[i],i=="dangerouslySetInnerHTML"?p=d:i=="children"||i in f||i=="value"&&"defaultValue"in f||i=="checked"&&"defaultChecked"in f||O(e,i,null,d,s);for(i in f)d=f[i],i=="children"?_=d:i=="dangerouslySetInnerHTML"?c=d:i=="value"?v=d:i=="checked"?b=d:l&&typeof d!="function"||$[i]===d||O(e,i,d,$[i],s);if(c)l||p&&(c.__html==p.__html||c.__html==e.innerHTML)||(e.innerHTML=c.__html),t.__k=[];else if(p&&(e.innerHTML=""),bt(t.type=="template"?e.content:e,z(_)?_:[_],t,n,r,h=="foreignObject"?"http://www.w3.org/1999/xhtml":s,o,a,o?o[0]:n.__k&&H(n,0),l,u),o!=null)for(i=o.length;i--;)et(o[i]);l&&h!="textarea"||(i="value",h=="progress"&&v==null?e.removeAttribute("value"):v!=null&&(v!==e[i]||h=="progress"&&!v||h=="option"&&v!=$[i])&&O(e,i,v,$[i],s),i="checked",b!=null&&b!=e[i]&&O(e,i,b,$[i],s))}return e}function rt(e,t,n){try{if(typeof e=="function"){var r=typeof e.__u=="function";r&&e.__u(),r&&t==null||(e.__u=e(t))}else e.current=t}catch(s){y.__e(s,n)}}function At(e,t,n){var r,s;if(y.unmount&&y.unmount(e),(r=e.ref)&&(r.current&&r.current!=e.__e||rt(r,null,t)),(r=e.__c)!=null){if(r.componentWillUnmount)try{r.componentWillUnmount()}catch(o){y.__e(o,t)}r.base=r.__P=r.__n=null}if(r=e.__k)for(s=0;s<r.length;s++)r[s]&&At(r[s],t,n||typeof e.type!="function");n||et(e.__e),e.__c=e.__=e.__e=void 0}function Yt(e,t,n){return this.constructor(e,n)}function Pt(e,t,n){var r,s,o,a;t==document&&(t=document.documentElement),y.__&&y.__(e,t),s=(r=typeof n=="function")?null:n&&n.__k||t.__k,o=[],a=[],ot(t,e=(!r&&n||t).__k=nt(G,null,[e]),s||J,J,t.namespaceURI,!r&&n?[n]:s?null:t.firstChild?V.call(t.childNodes):null,o,!r&&n?n:s?s.__e:t.firstChild,r,a),St(o,e,a),e.props.children=null}V=B.slice,y={__e:function(e,t,n,r){for(var s,o,a;t=t.__;)if((s=t.__c)&&!s.__)try{if((o=s.constructor)&&o.getDerivedStateFromError!=null&&(s.setState(o.getDerivedStateFromError(e)),a=s.__d),s.componentDidCatch!=null&&(s.componentDidCatch(e,r||{}),a=s.__d),a)return s.__E=s}catch(l){e=l}throw e}},vt=0,jt=function(e){return e!=null&&e.constructor===void 0},I.prototype.setState=function(e,t){var n;n=this.__s!=null&&this.__s!=this.state?this.__s:this.__s=E({},this.state),typeof e=="function"&&(e=e(E({},n),this.props)),e&&E(n,e),e!=null&&this.__v&&(t&&this._sb.push(t),ft(this))},I.prototype.forceUpdate=function(e){this.__v&&(this.__e=!0,e&&this.__h.push(e),ft(this))},I.prototype.render=G,N=[],gt=typeof Promise=="function"?Promise.prototype.then.bind(Promise.resolve()):setTimeout,yt=function(e,t){return e.__v.__b-t.__v.__b},j.__r=0,K=Math.random().toString(8),W="__d"+K,M="__a"+K,$t=/(PointerCapture)$|Capture$/i,tt=0,Y=mt(!1),Z=mt(!0),Vt=0;var L,k,_t,Et,st=0,Ut=[],w=y,Nt=w.__b,Ht=w.__r,qt=w.diffed,Tt=w.__c,Mt=w.unmount,Lt=w.__;function it(e,t){w.__h&&w.__h(k,e,st||t),st=0;var n=k.__H||(k.__H={__:[],__h:[]});return e>=n.__.length&&n.__.push({}),n.__[e]}function x(e){return st=1,Zt(Wt,e)}function Zt(e,t,n){var r=it(L++,2);if(r.t=e,!r.__c&&(r.__=[n?n(t):Wt(void 0,t),function(l){var u=r.__N?r.__N[0]:r.__[0],i=r.t(u,l);u!==i&&(r.__N=[i,r.__[1]],r.__c.setState({}))}],r.__c=k,!k.__f)){var s=function(l,u,i){if(!r.__c.__H)return!0;var c=!1,p=r.__c.props!==l;if(r.__c.__H.__.some(function(d){if(d.__N){c=!0;var v=d.__[0];d.__=d.__N,d.__N=void 0,v!==d.__[0]&&(p=!0)}}),o){var _=o.call(this,l,u,i);return c?_||p:_}return!c||p};k.__f=!0;var o=k.shouldComponentUpdate,a=k.componentWillUpdate;k.componentWillUpdate=function(l,u,i){if(this.__e){var c=o;o=void 0,s(l,u,i),o=c}a&&a.call(this,l,u,i)},k.shouldComponentUpdate=s}return r.__N||r.__}function D(e,t){var n=it(L++,3);!w.__s&&Ot(n.__H,t)&&(n.__=e,n.u=t,k.__H.__h.push(n))}function Ft(e,t){var n=it(L++,7);return Ot(n.__H,t)&&(n.__=e(),n.__H=t,n.__h=e),n.__}function te(){for(var e;e=Ut.shift();){var t=e.__H;if(e.__P&&t)try{t.__h.some(Q),t.__h.some(at),t.__h=[]}catch(n){t.__h=[],w.__e(n,e.__v)}}}w.__b=function(e){k=null,Nt&&Nt(e)},w.__=function(e,t){e&&t.__k&&t.__k.__m&&(e.__m=t.__k.__m),Lt&&Lt(e,t)},w.__r=function(e){Ht&&Ht(e),L=0;var t=(k=e.__c).__H;t&&(_t===k?(t.__h=[],k.__h=[],t.__.some(function(n){n.__N&&(n.__=n.__N),n.u=n.__N=void 0})):(t.__h.some(Q),t.__h.some(at),t.__h=[],L=0)),_t=k},w.diffed=function(e){qt&&qt(e);var t=e.__c;t&&t.__H&&(t.__H.__h.length&&(Ut.push(t)!==1&&Et===w.requestAnimationFrame||((Et=w.requestAnimationFrame)||ee)(te)),t.__H.__.some(function(n){n.u&&(n.__H=n.u,n.u=void 0)})),_t=k=null},w.__c=function(e,t){t.some(function(n){try{n.__h.some(Q),n.__h=n.__h.filter(function(r){return!r.__||at(r)})}catch(r){t.some(function(s){s.__h&&(s.__h=[])}),t=[],w.__e(r,n.__v)}}),Tt&&Tt(e,t)},w.unmount=function(e){Mt&&Mt(e);var t,n=e.__c;n&&n.__H&&(n.__H.__.some(function(r){try{Q(r)}catch(s){t=s}}),n.__H=void 0,t&&w.__e(t,n.__v))};var Dt=typeof requestAnimationFrame=="function";function ee(e){var t,n=function(){clearTimeout(r),Dt&&cancelAnimationFrame(t),setTimeout(e)},r=setTimeout(n,35);Dt&&(t=requestAnimationFrame(n))}function Q(e){var t=k,n=e.__c;typeof n=="function"&&(e.__c=void 0,n()),k=t}function at(e){var t=k;e.__c=e.__(),k=t}function Ot(e,t){return!e||e.length!==t.length||t.some(function(n,r){return n!==e[r]})}function Wt(e,t){return typeof t=="function"?t(e):t}var It=function(e,t,n,r){var s;t[0]=0;for(var o=1;o<t.length;o++){var a=t[o++],l=t[o]?(t[0]|=a?1:2,n[t[o++]]):t[++o];a===3?r[0]=l:a===4?r[1]=Object.assign(r[1]||{},l):a===5?(r[1]=r[1]||{})[t[++o]]=l:a===6?r[1][t[++o]]+=l+"":a?(s=e.apply(l,It(e,l,n,["",null])),r.push(s),l[0]?t[0]|=2:(t[o-2]=0,t[o]=s)):r.push(l)}return r},Rt=new Map;function Jt(e){var t=Rt.get(this);return t||(t=new Map,Rt.set(this,t)),(t=It(this,t.get(e)||(t.set(e,t=function(n){for(var r,s,o=1,a="",l="",u=[0],i=function(_){o===1&&(_||(a=a.replace(/^\s*\n\s*|\s*\n\s*$/g,"")))?u.push(0,_,a):o===3&&(_||a)?(u.push(3,_,a),o=2):o===2&&a==="..."&&_?u.push(4,_,0):o===2&&a&&!_?u.push(5,0,!0,a):o>=5&&((a||!_&&o===5)&&(u.push(o,0,a,s),o=6),_&&(u.push(o,_,0,s),o=6)),a=""},c=0;c<n.length;c++){c&&(o===1&&i(),i(c));for(var p=0;p<n[c].length;p++)r=n[c][p],o===1?r==="<"?(i(),u=[u],o=3):a+=r:o===4?a==="--"&&r===">"?(o=1,a=""):a=r+a[0]:l?r===l?l="":a+=r:r==='"'||r==="'"?l=r:r===">"?(i(),o=1):o&&(r==="="?(o=5,s=a,a=""):r==="/"&&(o<5||n[c][p+1]===">")?(i(),o===3&&(u=u[0]),o=u,(u=u[0]).push(2,0,o),o=0):r===" "||r==="	"||r===`
`||r==="\r"?(i(),o=2):a+=r),o===3&&a==="!--"&&(o=4,u=u[0])}return i(),u}(e)),t),arguments,[])).length>1?t:t[0]}var m=Jt.bind(nt),Bt={group_chat:{agent_ids:["IndustryExpertAgent","TechnicalAnalysisAgent","FundamentalAnalysisAgent"],query:"What stock should I buy?",option_label:"stocks"},handoff_workflow:{task:"Process refund for order #12345",steps:[{agent_id:"CustomerAgent"},{agent_id:"SellerAgent"},{agent_id:"PaymentAgent"},{agent_id:"NotificationAgent"}],context:{order_id:"12345"},failure_agent:"NotificationAgent"},collaborative_filtering:{agent_ids:["PriceAgent","QualityAgent","LocationAgent","ReviewsAgent"],weights:{price:.2,quality:.4,location:.3,reviews:.1},query:"Hotel in Paris near Eiffel Tower"},consensus:{problem:"Should we migrate to microservices?",wait_for_all_votes:!0},research:{query:"What is the latest lithium-ion battery recycling rate?"},route:{request_type:"stock_recommendation",query:"What stock should I buy?"},parallel:{patterns:[{name:"stocks",route:{request_type:"stock_recommendation",query:"Best stock?"}},{name:"hotels",route:{request_type:"hotel_recommendation",query:"Hotel in Paris"}}]}};async function ct(e){let t=await fetch(e);if(!t.ok)throw new Error(`${t.status} ${await t.text()}`);return t.json()}async function ut(e,t,n){let r={"Content-Type":"application/json"};n&&(r.Authorization=`Bearer ${n}`);let s,o;try{s=await fetch(e,{method:"POST",headers:r,body:JSON.stringify(t)}),o=await s.text()}catch(a){return{ok:!1,message:`the dashboard could not be reached: ${a.message}`}}try{let a=JSON.parse(o);return s.ok?{ok:!0,...a}:{ok:!1,message:a.message||o}}catch{return{ok:!1,message:o}}}function dt({id:e,token:t,set:n}){return m`<input
    id=${e}
    type="password"
    placeholder="gateway credential"
    value=${t}
    onInput=${r=>n(r.target.value)}
  />`}function T(e,t=2){return typeof e=="number"?e.toFixed(t):"\u2013"}function lt({title:e,points:t,series:n,unit:r}){let l=t.flatMap(p=>n.map(_=>p[_.key]||0)),u=Math.max(1e-9,...l)*1.1,i=p=>t.map((_,d)=>{let v=28+d/Math.max(1,t.length-1)*426,b=140-28/2-(_[p]||0)/u*112;return`${d?"L":"M"}${v.toFixed(1)},${b.toFixed(1)}`}).join(" "),c=t[t.length-1]||{};return m`<figure class="chart" data-chart=${e}>
    <figcaption>
      ${e}
      ${n.map(p=>m`<span class="legend" style=${`color:${p.color}`}
          >${p.label} ${T(c[p.key])} ${r}</span
        >`)}
    </figcaption>
    <svg viewBox=${"0 0 460 140"} role="img" aria-label=${e}>
      <text x="2" y="12" class="axis">${T(u,1)}</text>
      <text x="2" y=${136} class="axis">0</text>
      ${n.map(p=>m`<path d=${i(p.key)} fill="none" stroke=${p.color} stroke-width="1.8" />`)}
    </svg>
  </figure>`}function ne({agents:e}){return m`<section>
    <h2>Agents <small>${e.length}</small></h2>
    <table id="agents">
      <thead>
        <tr>
          <th>agent</th><th>types</th><th>health</th><th>HIGH</th><th>MEDIUM</th><th>LOW</th>
          <th>in flight</th><th>dead</th><th>address</th>
        </tr>
      </thead>
      <tbody>
        ${e.map(t=>m`<tr data-agent=${t.agent_id}>
            <td class="id">${t.agent_id}</td>
            <td>${t.agent_types.join(", ")}</td>
            <td class=${`health ${t.health}`}>${t.health}</td>
            <td>${t.high}</td><td>${t.medium}</td><td>${t.low}</td>
            <td>${t.in_flight}</td><td>${t.dead_letters}</td>
            <td class="addr">${t.address}</td>
          </tr>`)}
      </tbody>
    </table>
  </section>`}function oe({workflows:e}){let t=[...e].reverse();return m`<section>
    <h2>Hand-off workflows <small>${e.length}</small></h2>
    ${t.length?m`<table id="workflows">
          <thead>
            <tr>
              <th>workflow</th><th>step</th><th>with</th><th>from</th><th>task</th>
              <th>handed off</th>
            </tr>
          </thead>
          <tbody>
            ${t.map(n=>m`<tr data-workflow=${n.workflow_id}>
                <td><code>${n.workflow_id}</code></td>
                <td>${n.step}</td>
                <td class="id">${n.current_agent}</td>
                <td>${n.from_agent}</td>
                <td>${n.task_description}</td>
                <td>${n.handed_off_at&&new Date(n.handed_off_at).toLocaleTimeString()}</td>
              </tr>`)}
          </tbody>
        </table>`:m`<p class="note" id="workflows">none</p>`}
  </section>`}function re({trace:e}){if(!e)return null;if(!e.spans.length)return m`<p class="note">${e.note||"no spans"}</p>`;let t=new Set(e.critical_path),n=Math.max(e.total_ms,1e-6);return m`<div class="waterfall" id="waterfall">
    <p>${e.spans.length} spans, ${T(e.total_ms)} ms; critical path highlighted</p>
    ${e.spans.map(r=>m`<div class=${`span ${t.has(r.span_id)?"critical":""}`}
        data-span=${r.span_id}>
        <span class="label" title=${r.service}>${r.name}</span>
        <span class="track">
          <span
            class="bar"
            style=${`left:${r.offset_ms/n*100}%;width:${Math.max(.4,r.duration_ms/n*100)}%`}
          ></span>
        </span>
        <span class="ms">${T(r.duration_ms)} ms</span>
      </div>`)}
  </div>`}function _e(e,t){let n=T(t.accuracy*100,0);return`${e} accuracy ${n}% (${t.satisfied} of ${t.rated} rated runs)`}function se({run:e,state:t}){let[n,r]=x(""),[s,o]=x(null);if(D(()=>o(null),[e.run_id]),!t.allow_runs||!["COMPLETED","PARTIAL"].includes(e.status))return null;let a=async l=>o(await ut(`/api/runs/${e.run_id}/feedback`,{satisfied:l},n));return m`<p id="feedback">
    Did this outcome satisfy you?
    ${t.credential_required&&m`<${dt} id="feedback-token" token=${n} set=${r} />`}
    <button id="satisfied" onClick=${()=>a(!0)}>Yes</button>
    <button id="not-satisfied" onClick=${()=>a(!1)}>No</button>
    ${s&&(s.ok?m`<span id="accuracy">${_e(e.pattern,s)}</span>`:m`<span class="error" id="feedback-error">${s.message}</span>`)}
  </p>`}function ae({run:e,events:t,state:n}){let[r,s]=x(null);return D(()=>s(null),[e.run_id]),m`<section id="run-detail" data-run=${e.run_id}>
    <h2>
      ${e.pattern} <code>${e.run_id}</code>
      <span class=${`status ${e.status}`}>${e.status}</span>
      <button
        id="show-trace"
        onClick=${async()=>s(await ct(`/api/traces/${e.run_id}`))}
      >
        Trace waterfall
      </button>
    </h2>
    <ol class="events">
      ${t.map(o=>m`<li class=${`event ${o.kind}`} data-kind=${o.kind}>
          <span class="kind">${o.kind}</span>
          ${o.agent_id&&m`<span class="agent">${o.agent_id}</span>`}
          <span class="summary">${o.summary}</span>
          <span class="ms">${T(o.elapsed_ms,1)} ms</span>
        </li>`)}
    </ol>
    <${se} run=${e} state=${n} />
    <${re} trace=${r} />
  </section>`}function ie({state:e,onStarted:t}){let[n,r]=x("group_chat"),[s,o]=x(JSON.stringify(Bt.group_chat,null,2)),[a,l]=x(""),[u,i]=x("");if(!e.allow_runs)return m`<section><p class="note">Read-only dashboard.</p></section>`;let c=_=>{r(_),o(JSON.stringify(Bt[_]||{},null,2))};return m`<section>
    <h2>Start a pattern</h2>
    <form id="start" onSubmit=${async _=>{_.preventDefault(),i("");let d;try{d=JSON.parse(s)}catch(b){i(`not JSON: ${b.message}`);return}let v=await ut(`/api/patterns/${n}`,d,a);if(!v.ok){i(v.message);return}t(v.run_id)}}>
      <select id="pattern" value=${n} onChange=${_=>c(_.target.value)}>
        ${e.patterns.map(_=>m`<option value=${_}>${_}</option>`)}
      </select>
      ${e.credential_required&&m`<${dt} id="token" token=${a} set=${l} />`}
      <textarea id="body" rows="8" value=${s} onInput=${_=>o(_.target.value)} />
      <button id="run" type="submit">Start</button>
      ${u&&m`<p class="error" id="start-error">${u}</p>`}
    </form>
  </section>`}function le({state:e}){let[t,n]=x(null),[r,s]=x(""),[o,a]=x(null),l=async()=>n(await ct("/api/dead-letters"));D(()=>{l()},[]);let u=async c=>{let p={agent_id:c.to_agent,message_ids:[c.message_id]};a(await ut("/api/dead-letters/requeue",p,r)),await l()},i=e.allow_runs;return m`<section>
    <h2>Dead letters <button onClick=${l}>Refresh</button></h2>
    ${i&&e.credential_required&&m`<${dt} id="requeue-token" token=${r} set=${s} />`}
    ${o&&(o.ok?m`<p id="requeue-result">
          ${o.requeued} requeued${o.left?`, ${o.left} left (queue full)`:""}
        </p>`:m`<p class="error" id="requeue-result">${o.message}</p>`)}
    ${t&&(t.length?m`<table id="dead-letters">
          <thead>
            <tr>
              <th>message</th><th>from</th><th>to</th><th>reason</th><th>at</th>
              ${i&&m`<th></th>`}
            </tr>
          </thead>
          <tbody>
            ${t.map(c=>m`<tr>
                <td><code>${c.message_id}</code></td><td>${c.from_agent}</td>
                <td>${c.to_agent}</td><td>${c.reason}</td><td>${c.dead_lettered_at}</td>
                ${i&&m`<td>
                  <button class="requeue" data-message=${c.message_id} onClick=${()=>u(c)}>
                    Requeue
                  </button>
                </td>`}
              </tr>`)}
          </tbody>
        </table>`:m`<p class="note" id="dead-letters">none</p>`)}
  </section>`}function ce(){let[e,t]=x(null),[n,r]=x([]),[s,o]=x([]),[a,l]=x(null),[u,i]=x({}),[c,p]=x([]),[_,d]=x(!1);D(()=>{let f=new EventSource("/api/events");return f.addEventListener("open",()=>d(!0)),f.addEventListener("error",()=>d(!1)),f.addEventListener("state",h=>{let g=JSON.parse(h.data);t(g),r(g.history),o(g.runs),p(g.workflows||[])}),f.addEventListener("workflows",h=>p(JSON.parse(h.data))),f.addEventListener("workflow",h=>{let{key:g,row:S}=JSON.parse(h.data);p(C=>{let A=C.filter(U=>U.key!==g);return S?[...A,S].slice(-100):A})}),f.addEventListener("snapshot",h=>{let g=JSON.parse(h.data);t(S=>({...S,...g})),r(S=>[...S.slice(-299),g.point])}),f.addEventListener("event",h=>{let{run:g,event:S}=JSON.parse(h.data);o(C=>[g,...C.filter(A=>A.run_id!==g.run_id)].slice(0,50)),i(C=>({...C,[g.run_id]:[...C[g.run_id]||[],S]}))}),()=>f.close()},[]);let v=async f=>{l(f);try{let h=await ct(`/api/runs/${f}`);i(g=>{let S=g[f]||[];return{...g,[f]:h.events.length>=S.length?h.events:S}})}catch{}},b=Ft(()=>s.find(f=>f.run_id===a),[s,a]);if(!e)return m`<p class="note">connecting…</p>`;let $=e.totals||{};return m`<main>
    <header>
      <h1>agentmesh</h1>
      <span id="live" class=${_?"live":"offline"}>${_?"live":"offline"}</span>
      <span>held <b>${$.held}</b></span>
      <span>sent <b>${$.sent_count}</b></span>
      <span>delivered <b>${$.delivered_count}</b></span>
      <span>expired <b>${$.expired_count}</b></span>
      <span>dead <b>${$.dead_lettered_count}</b></span>
      <span title="requests whose requester gave up">withdrawn <b>${$.withdrawn_count}</b></span>
    </header>
    <div class="charts">
      <${lt}
        title="Messages per second"
        points=${n}
        unit="/s"
        series=${[{key:"sent_per_s",label:"sent",color:"#2563eb"},{key:"delivered_per_s",label:"delivered",color:"#16a34a"}]}
      />
      <${lt}
        title="Send latency"
        points=${n}
        unit="ms"
        series=${[{key:"send_p50_ms",label:"p50",color:"#2563eb"},{key:"send_p95_ms",label:"p95",color:"#d97706"},{key:"send_p99_ms",label:"p99",color:"#dc2626"}]}
      />
      <${lt}
        title="Request/response latency"
        points=${n}
        unit="ms"
        series=${[{key:"roundtrip_p50_ms",label:"p50",color:"#2563eb"},{key:"roundtrip_p95_ms",label:"p95",color:"#d97706"},{key:"roundtrip_p99_ms",label:"p99",color:"#dc2626"}]}
      />
    </div>
    <${ne} agents=${e.agents||[]} />
    <${oe} workflows=${c} />
    <div class="columns">
      <section>
        <h2>Pattern runs</h2>
        <ul id="runs">
          ${s.map(f=>m`<li
              class=${`run ${f.run_id===a?"selected":""}`}
              data-run=${f.run_id}
              onClick=${()=>v(f.run_id)}
            >
              <span class="pattern">${f.pattern}</span> <code>${f.run_id}</code>
              <span class=${`status ${f.status}`}>${f.status}</span>
            </li>`)}
        </ul>
      </section>
      <${ie} state=${e} onStarted=${v} />
    </div>
    ${b&&m`<${ae} run=${b} events=${u[b.run_id]||[]} state=${e} />`}
    <${le} state=${e} />
  </main>`}Pt(m`<${ce} />`,document.getElementById("app"));
