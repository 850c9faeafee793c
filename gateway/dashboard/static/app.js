var V,g,vt,jt,N,pt,$t,gt,K,W,L,yt,tt,Y,Z,Vt,J={},B=[],zt=/acit|ex(?:s|g|n|p|$)|rph|grid|ows|mnc|ntw|ine[ch]|zoo|^ord|itera/i,z=Array.isArray;function E(e,t){for(var n in t)e[n]=t[n];return e}function et(e){e&&e.parentNode&&e.parentNode.removeChild(e)}function nt(e,t,n){var o,_,r,a={};for(r in t)r=="key"?o=t[r]:r=="ref"?_=t[r]:a[r]=t[r];if(arguments.length>2&&(a.children=arguments.length>3?V.call(arguments,2):n),typeof e=="function"&&e.defaultProps!=null)for(r in e.defaultProps)a[r]===void 0&&(a[r]=e.defaultProps[r]);return R(e,a,o,_,null)}function R(e,t,n,o,_){var r={type:e,props:t,key:n,ref:o,__k:null,__:null,__b:0,__e:null,__c:null,constructor:void 0,__v:_??++vt,__i:-1,__u:0};return _==null&&g.vnode!=null&&g.vnode(r),r}function G(e){return e.children}function I(e,t){this.props=e,this.context=t}function H(e,t){if(t==null)return e.__?H(e.__,e.__i+1):null;for(var n;t<e.__k.length;t++)if((n=e.__k[t])!=null&&n.__e!=null)return n.__e;return typeof e.type=="function"?H(e):null}function Gt(e){if(e.__P&&e.__d){var t=e.__v,n=t.__e,o=[],_=[],r=E({},t);r.__v=t.__v+1,g.vnode&&g.vnode(r),rt(e.__P,r,t,e.__n,e.__P.namespaceURI,32&t.__u?[n]:null,o,n??H(t),!!(32&t.__u),_),r.__v=t.__v,r.__.__k[r.__i]=r,St(o,r,_),t.__e=t.__=null,r.__e!=n&&kt(r)}}function kt(e){if((e=e.__)!=null&&e.__c!=null)return e.__e=e.__c.base=null,e.__k.some(function(t){if(t!=null&&t.__e!=null)return e.__e=e.__c.base=t.__e}),kt(e)}function ft(e){(!e.__d&&(e.__d=!0)&&N.push(e)&&!j.__r++||pt!=g.debounceRendering)&&((pt=g.debounceRendering)||$t)(j)}function j(){try{for(var e,t=1;N.length;)N.length>t&&N.sort(gt),e=N.shift(),t=N.length,Gt(e)}finally{N.length=j.__r=0}}function bt(e,t,n,o,_,r,a,l,c,i,u){var p,s,d,v,b,y,f=o&&o.__k||B,h=t.length;for(c=Qt(n,t,f,c,h),p=0;p<h;p++)(d=n.__k[p])!=null&&(s=d.__i!=-1&&f[d.__i]||J,d.__i=p,y=rt(e,d,s,_,r,a,l,c,i,u),v=d.__e,d.ref&&s.ref!=d.ref&&(s.ref&&ot(s.ref,null,d),u.push(d.ref,d.__c||v,d)),b==null&&v!=null&&(b=v),4&d.__u?(c=wt(d,c,e),s.__e&&(s.__e=null)):typeof d.type=="function"&&y!==void 0?c=y:v&&(c=v.nextSibling),d.__u&=-7);return n.__e=b,c}function Qt(e,t,n,o,_){var r,a,l,c,i,u=n.length,p=u,s=0;for(e.__k=new Array(_),r=0;r<_;r++)(a=t[r])!=null&&typeof a!="boolean"&&typeof a!="function"?(typeof a=="string"||typeof a=="number"||typeof a=="bigint"||a.constructor==String?a=e.__k[r]=R(null,a,null,null,null):z(a)?a=e.__k[r]=R(G,{children:a},null,null,null):a.constructor===void 0&&a.__b>0?a=e.__k[r]=R(a.type,a.props,a.key,a.ref?a.ref:null,a.__v):e.__k[r]=a,c=r+s,a.__=e,a.__b=e.__b+1,l=null,(i=a.__i=Xt(a,n,c,p))!=-1&&(p--,(l=n[i])&&(l.__u|=2)),l==null||l.__v==null?(i==-1&&(_>u?s--:_<u&&s++),typeof a.type!="function"&&(a.__u|=4)):i!=c&&(i==c-1?s--:i==c+1?s++:(i>c?s--:s++,a.__u|=4))):e.__k[r]=null;if(p)for(r=0;r<u;r++)(l=n[r])!=null&&!(2&l.__u)&&(l.__e==o&&(o=H(l)),At(l,l));return o}function wt(e,t,n){var o,_;if(typeof e.type=="function"){for(o=e.__k,_=0;o&&_<o.length;_++)o[_]&&(o[_].__=e,t=wt(o[_],t,n));return t}e.__e!=t&&(t&&e.type&&!t.parentNode&&(t=H(e)),t=n.insertBefore(e.__e,t||null));do t=t&&t.nextSibling;while(t!=null&&t.nodeType==8);return t}function Xt(e,t,n,o){var _,r,a,l=e.key,c=e.type,i=t[n],u=i!=null&&(2&i.__u)==0;if(i===null&&l==null||u&&l==i.key&&c==i.type)return n;if(o>(u?1:0)){for(_=n-1,r=n+1;_>=0||r<t.length;)if((i=t[a=_>=0?_--:r++])!=null&&!(2&i.__u)&&l==i.key&&c==i.type)return a}return-1}function ht(e,t,n){t[0]=="-"?e.setProperty(t,n??""):e[t]=n==null?"":typeof n!="number"||zt.test(t)?n:n+"px"}function O(e,t,n,o,_){var r,a;t:if(t=="style")if(typeof n=="string")e.style.cssText=n;else{if(typeof o=="string"&&(e.style.cssText=o=""),o)for(t in o)n&&t in n||ht(e.style,t,"");if(n)for(t in n)o&&n[t]==o[t]||ht(e.style,t,n[t])}else if(t[0]=="o"&&t[1]=="n")r=t!=(t=t.replace(yt,"$1")),a=t.toLowerCase(),t=a in e||t=="onFocusOut"||t=="onFocusIn"?a.slice(2):t.slice(2),e.l||(e.l={}),e.l[t+r]=n,n?o?n[L]=o[L]:(n[L]=tt,e.addEventListener(t,r?Z:Y,r)):e.removeEventListener(t,r?Z:Y,r);else{if(_=="http://www.w3.org/2000/svg")t=t.replace(/xlink(H|:h)/,"h").replace(/sName$/,"s");else if(t!="width"&&t!="height"&&t!="href"&&t!="list"&&t!="form"&&t!="tabIndex"&&t!="download"&&t!="rowSpan"&&t!="colSpan"&&t!="role"&&t!="popover"&&t in e)try{e[t]=n??"";break t}catch{}typeof n=="function"||(n==null||n===!1&&t[4]!="-"?e.removeAttribute(t):e.setAttribute(t,t=="popover"&&n==1?"":n))}}function mt(e){return function(t){if(this.l){var n=this.l[t.type+e];if(t[W]==null)t[W]=tt++;else if(t[W]<n[L])return;return n(g.event?g.event(t):t)}}}function rt(e,t,n,o,_,r,a,l,c,i){var u,p,s,d,v,b,y,f,h,$,S,C,A,U,F,X,P=t.type;if(t.constructor!==void 0)return null;128&n.__u&&(c=!!(32&n.__u),r=[l=t.__e=n.__e]),(u=g.__b)&&u(t);t:if(typeof P=="function"){p=a.length;try{if(h=t.props,$=P.prototype&&P.prototype.render,S=(u=P.contextType)&&o[u.__c],C=u?S?S.props.value:u.__:o,n.__c?f=(s=t.__c=n.__c).__=s.__E:($?t.__c=s=new P(h,C):(t.__c=s=new I(h,C),s.constructor=P,s.render=Yt),S&&S.sub(s),s.state||(s.state={}),s.__n=o,d=s.__d=!0,s.__h=[],s._sb=[]),$&&s.__s==null&&(s.__s=s.state),$&&P.getDerivedStateFromProps!=null&&(s.__s==s.state&&(s.__s=E({},s.__s)),E(s.__s,P.getDerivedStateFromProps(h,s.__s))),v=s.props,b=s.state,s.__v=t,d)$&&P.getDerivedStateFromProps==null&&s.componentWillMount!=null&&s.componentWillMount(),$&&s.componentDidMount!=null&&s.__h.push(s.componentDidMount);else{if($&&P.getDerivedStateFromProps==null&&h!==v&&s.componentWillReceiveProps!=null&&s.componentWillReceiveProps(h,C),t.__v==n.__v||!s.__e&&s.shouldComponentUpdate!=null&&s.shouldComponentUpdate(h,s.__s,C)===!1){t.__v!=n.__v&&(s.props=h,s.state=s.__s,s.__d=!1),t.__e=n.__e,t.__k=n.__k,t.__k.some(function(q){q&&(q.__=t)}),B.push.apply(s.__h,s._sb),s._sb=[],s.__h.length&&a.push(s),l=H(n);break t}s.componentWillUpdate!=null&&s.componentWillUpdate(h,s.__s,C),$&&s.componentDidUpdate!=null&&s.__h.push(function(){s.componentDidUpdate(v,b,y)})}if(s.context=C,s.props=h,s.__P=e,s.__e=!1,A=g.__r,U=0,$)s.state=s.__s,s.__d=!1,A&&A(t),u=s.render(s.props,s.state,s.context),B.push.apply(s.__h,s._sb),s._sb=[];else do s.__d=!1,A&&A(t),u=s.render(s.props,s.state,s.context),s.state=s.__s;while(s.__d&&++U<25);s.state=s.__s,s.getChildContext!=null&&(o=E(E({},o),s.getChildContext())),$&&!d&&s.getSnapshotBeforeUpdate!=null&&(y=s.getSnapshotBeforeUpdate(v,b)),F=u!=null&&u.type===G&&u.key==null?Ct(u.props.children):u,l=bt(e,z(F)?F:[F],t,n,o,_,r,a,l,c,i),s.base=t.__e,t.__u&=-161,s.__h.length&&a.push(s),f&&(s.__E=s.__=null)}catch(q){if(a.length=p,t.__v=null,c||r!=null){if(q.then){for(t.__u|=c?160:128;l&&l.nodeType==8&&l.nextSibling;)l=l.nextSibling;r!=null&&(r[r.indexOf(l)]=null),t.__e=l}else if(r!=null)for(X=r.length;X--;)et(r[X])}else t.__e=n.__e;t.__k==null&&(t.__k=n.__k||[]),q.then||xt(t),g.__e(q,t,n)}}else r==null&&t.__v==n.__v?(t.__k=n.__k,t.__e=n.__e):l=t.__e=Kt(n.__e,t,n,o,_,r,a,c,i);return(u=g.diffed)&&u(t),128&t.__u?void 0:l}function xt(e){e&&(e.__c&&(e.__c.__e=!0),e.__k&&e.__k.some(xt))}function St(e,t,n){for(var o=0;o<n.length;o++)ot(n[o],n[++o],n[++o]);g.__c&&g.__c(t,e),e.some(function(_){try{e=_.__h,_.__h=[],e.some(function(r){r.call(_)})}catch(r){g.__e(r,_.__v)}})}function Ct(e){return typeof e!="object"||e==null||e.__b>0?e:z(e)?e.map(Ct):e.constructor!==void 0?null:E({},e)}function Kt(e,t,n,o,_,r,a,l,c){var i,u,p,s,d,v,b,y=n.props||J,f=t.props,h=t.type;if(h=="svg"?_="http://www.w3.org/2000/svg":h=="math"?_="http://www.w3.org/1998/Math/MathML":_||(_="http://www.w3.org/1999/xhtml"),r!=null){for(i=0;i<r.length;i++)if((d=r[i])&&"setAttribute"in d==!!h&&(h?d.localName==h:d.nodeType==3)){e=d,r[i]=null;break}}if(e==null){if(h==null)return document.createTextNode(f);e=document.createElementNS(_,h,f.is&&f),l&&(g.__m&&g.__m(t,r),l=!1),r=null}if(h==null)y===f||l&&e.data==f||(e.data=f);else{if(r=h=="textarea"&&f.defaultValue!=null?null:r&&V.call(e.childNodes),!l&&r!=null)for(y={},i=0;i<e.attributes.length;i++)y[(d=e.attributes[i]).name]=d.value;for(i in y)d=y[i],i=="dangerouslySetInnerHTML"?p=d:i=="children"||i in f||i=="value"&&"defaultValue"in f||i=="checked"&&"defaultChecked"in f||O(e,i,null,d,_);for(i in f)d=f[i],i=="children"?s=d:i=="dangerouslySetInnerHTML"?u=d:i=="value"?v=d:i=="checked"?b=d:l&&typeof d!="function"||y[i]===d||O(e,i,d,y[i],_);if(u)l||p&&(u.__html==p.__html||u.__html==e.innerHTML)||(e.innerHTML=u.__html),t.__k=[];else if(p&&(e.innerHTML=""),bt(t.type=="template"?e.content:e,z(s)?s:[s],t,n,o,h=="foreignObject"?"http://www.w3.org/1999/xhtml":_,r,a,r?r[0]:n.__k&&H(n,0),l,c),r!=null)for(i=r.length;i--;)et(r[i]);l&&h!="textarea"||(i="value",h=="progress"&&v==null?e.removeAttribute("value"):v!=null&&(v!==e[i]||h=="progress"&&!v||h=="option"&&v!=y[i])&&O(e,i,v,y[i],_),i="checked",b!=null&&b!=e[i]&&O(e,i,b,y[i],_))}return e}function ot(e,t,n){try{if(typeof e=="function"){var o=typeof e.__u=="function";o&&e.__u(),o&&t==null||(e.__u=e(t))}else e.current=t}catch(_){g.__e(_,n)}}function At(e,t,n){var o,_;if(g.unmount&&g.unmount(e),(o=e.ref)&&(o.current&&o.current!=e.__e||ot(o,null,t)),(o=e.__c)!=null){if(o.componentWillUnmount)try{o.componentWillUnmount()}catch(r){g.__e(r,t)}o.base=o.__P=o.__n=null}if(o=e.__k)for(_=0;_<o.length;_++)o[_]&&At(o[_],t,n||typeof e.type!="function");n||et(e.__e),e.__c=e.__=e.__e=void 0}function Yt(e,t,n){return this.constructor(e,n)}function Pt(e,t,n){var o,_,r,a;t==document&&(t=document.documentElement),g.__&&g.__(e,t),_=(o=typeof n=="function")?null:n&&n.__k||t.__k,r=[],a=[],rt(t,e=(!o&&n||t).__k=nt(G,null,[e]),_||J,J,t.namespaceURI,!o&&n?[n]:_?null:t.firstChild?V.call(t.childNodes):null,r,!o&&n?n:_?_.__e:t.firstChild,o,a),St(r,e,a),e.props.children=null}V=B.slice,g={__e:function(e,t,n,o){for(var _,r,a;t=t.__;)if((_=t.__c)&&!_.__)try{if((r=_.constructor)&&r.getDerivedStateFromError!=null&&(_.setState(r.getDerivedStateFromError(e)),a=_.__d),_.componentDidCatch!=null&&(_.componentDidCatch(e,o||{}),a=_.__d),a)return _.__E=_}catch(l){e=l}throw e}},vt=0,jt=function(e){return e!=null&&e.constructor===void 0},I.prototype.setState=function(e,t){var n;n=this.__s!=null&&this.__s!=this.state?this.__s:this.__s=E({},this.state),typeof e=="function"&&(e=e(E({},n),this.props)),e&&E(n,e),e!=null&&this.__v&&(t&&this._sb.push(t),ft(this))},I.prototype.forceUpdate=function(e){this.__v&&(this.__e=!0,e&&this.__h.push(e),ft(this))},I.prototype.render=G,N=[],$t=typeof Promise=="function"?Promise.prototype.then.bind(Promise.resolve()):setTimeout,gt=function(e,t){return e.__v.__b-t.__v.__b},j.__r=0,K=Math.random().toString(8),W="__d"+K,L="__a"+K,yt=/(PointerCapture)$|Capture$/i,tt=0,Y=mt(!1),Z=mt(!0),Vt=0;var M,k,st,Et,_t=0,Ut=[],w=g,Nt=w.__b,Ht=w.__r,qt=w.diffed,Tt=w.__c,Lt=w.unmount,Mt=w.__;function it(e,t){w.__h&&w.__h(k,e,_t||t),_t=0;var n=k.__H||(k.__H={__:[],__h:[]});return e>=n.__.length&&n.__.push({}),n.__[e]}function x(e){return _t=1,Zt(Wt,e)}function Zt(e,t,n){var o=it(M++,2);if(o.t=e,!o.__c&&(o.__=[n?n(t):Wt(void 0,t),function(l){var c=o.__N?o.__N[0]:o.__[0],i=o.t(c,l);c!==i&&(o.__N=[i,o.__[1]],o.__c.setState({}))}],o.__c=k,!k.__f)){var _=function(l,c,i){if(!o.__c.__H)return!0;var u=!1,p=o.__c.props!==l;if(o.__c.__H.__.some(function(d){if(d.__N){u=!0;var v=d.__[0];d.__=d.__N,d.__N=void 0,v!==d.__[0]&&(p=!0)}}),r){var s=r.call(this,l,c,i);return u?s||p:s}return!u||p};k.__f=!0;var r=k.shouldComponentUpdate,a=k.componentWillUpdate;k.componentWillUpdate=function(l,c,i){if(this.__e){var u=r;r=void 0,_(l,c,i),r=u}a&&a.call(this,l,c,i)},k.shouldComponentUpdate=_}return o.__N||o.__}function D(e,t){var n=it(M++,3);!w.__s&&Ot(n.__H,t)&&(n.__=e,n.u=t,k.__H.__h.push(n))}function Ft(e,t){var n=it(M++,7);return Ot(n.__H,t)&&(n.__=e(),n.__H=t,n.__h=e),n.__}function te(){for(var e;e=Ut.shift();){var t=e.__H;if(e.__P&&t)try{t.__h.some(Q),t.__h.some(at),t.__h=[]}catch(n){t.__h=[],w.__e(n,e.__v)}}}w.__b=function(e){k=null,Nt&&Nt(e)},w.__=function(e,t){e&&t.__k&&t.__k.__m&&(e.__m=t.__k.__m),Mt&&Mt(e,t)},w.__r=function(e){Ht&&Ht(e),M=0;var t=(k=e.__c).__H;t&&(st===k?(t.__h=[],k.__h=[],t.__.some(function(n){n.__N&&(n.__=n.__N),n.u=n.__N=void 0})):(t.__h.some(Q),t.__h.some(at),t.__h=[],M=0)),st=k},w.diffed=function(e){qt&&qt(e);var t=e.__c;t&&t.__H&&(t.__H.__h.length&&(Ut.push(t)!==1&&Et===w.requestAnimationFrame||((Et=w.requestAnimationFrame)||ee)(te)),t.__H.__.some(function(n){n.u&&(n.__H=n.u,n.u=void 0)})),st=k=null},w.__c=function(e,t){t.some(function(n){try{n.__h.some(Q),n.__h=n.__h.filter(function(o){return!o.__||at(o)})}catch(o){t.some(function(_){_.__h&&(_.__h=[])}),t=[],w.__e(o,n.__v)}}),Tt&&Tt(e,t)},w.unmount=function(e){Lt&&Lt(e);var t,n=e.__c;n&&n.__H&&(n.__H.__.some(function(o){try{Q(o)}catch(_){t=_}}),n.__H=void 0,t&&w.__e(t,n.__v))};var Dt=typeof requestAnimationFrame=="function";function ee(e){var t,n=function(){clearTimeout(o),Dt&&cancelAnimationFrame(t),setTimeout(e)},o=setTimeout(n,35);Dt&&(t=requestAnimationFrame(n))}function Q(e){var t=k,n=e.__c;typeof n=="function"&&(e.__c=void 0,n()),k=t}function at(e){var t=k;e.__c=e.__(),k=t}function Ot(e,t){return!e||e.length!==t.length||t.some(function(n,o){return n!==e[o]})}function Wt(e,t){return typeof t=="function"?t(e):t}var It=function(e,t,n,o){var _;t[0]=0;for(var r=1;r<t.length;r++){var a=t[r++],l=t[r]?(t[0]|=a?1:2,n[t[r++]]):t[++r];a===3?o[0]=l:a===4?o[1]=Object.assign(o[1]||{},l):a===5?(o[1]=o[1]||{})[t[++r]]=l:a===6?o[1][t[++r]]+=l+"":a?(_=e.apply(l,It(e,l,n,["",null])),o.push(_),l[0]?t[0]|=2:(t[r-2]=0,t[r]=_)):o.push(l)}return o},Rt=new Map;function Jt(e){var t=Rt.get(this);return t||(t=new Map,Rt.set(this,t)),(t=It(this,t.get(e)||(t.set(e,t=function(n){for(var o,_,r=1,a="",l="",c=[0],i=function(s){r===1&&(s||(a=a.replace(/^\s*\n\s*|\s*\n\s*$/g,"")))?c.push(0,s,a):r===3&&(s||a)?(c.push(3,s,a),r=2):r===2&&a==="..."&&s?c.push(4,s,0):r===2&&a&&!s?c.push(5,0,!0,a):r>=5&&((a||!s&&r===5)&&(c.push(r,0,a,_),r=6),s&&(c.push(r,s,0,_),r=6)),a=""},u=0;u<n.length;u++){u&&(r===1&&i(),i(u));for(var p=0;p<n[u].length;p++)o=n[u][p],r===1?o==="<"?(i(),c=[c],r=3):a+=o:r===4?a==="--"&&o===">"?(r=1,a=""):a=o+a[0]:l?o===l?l="":a+=o:o==='"'||o==="'"?l=o:o===">"?(i(),r=1):r&&(o==="="?(r=5,_=a,a=""):o==="/"&&(r<5||n[u][p+1]===">")?(i(),r===3&&(c=c[0]),r=c,(c=c[0]).push(2,0,r),r=0):o===" "||o==="	"||o===`
`||o==="\r"?(i(),r=2):a+=o),r===3&&a==="!--"&&(r=4,c=c[0])}return i(),c}(e)),t),arguments,[])).length>1?t:t[0]}var m=Jt.bind(nt),Bt={group_chat:{agent_ids:["IndustryExpertAgent","TechnicalAnalysisAgent","FundamentalAnalysisAgent"],query:"What stock should I buy?",option_label:"stocks"},handoff_workflow:{task:"Process refund for order #12345",steps:[{agent_id:"CustomerAgent"},{agent_id:"SellerAgent"},{agent_id:"PaymentAgent"},{agent_id:"NotificationAgent"}],context:{order_id:"12345"},failure_agent:"NotificationAgent"},collaborative_filtering:{agent_ids:["PriceAgent","QualityAgent","LocationAgent","ReviewsAgent"],weights:{price:.2,quality:.4,location:.3,reviews:.1},query:"Hotel in Paris near Eiffel Tower"},consensus:{problem:"Should we migrate to microservices?",wait_for_all_votes:!0},research:{query:"What is the latest lithium-ion battery recycling rate?"},route:{request_type:"stock_recommendation",query:"What stock should I buy?"},parallel:{patterns:[{name:"stocks",route:{request_type:"stock_recommendation",query:"Best stock?"}},{name:"hotels",route:{request_type:"hotel_recommendation",query:"Hotel in Paris"}}]}};async function ut(e){let t=await fetch(e);if(!t.ok)throw new Error(`${t.status} ${await t.text()}`);return t.json()}async function ct(e,t,n){let o={"Content-Type":"application/json"};n&&(o.Authorization=`Bearer ${n}`);let _,r;try{_=await fetch(e,{method:"POST",headers:o,body:JSON.stringify(t)}),r=await _.text()}catch(a){return{ok:!1,message:`the dashboard could not be reached: ${a.message}`}}try{let a=JSON.parse(r);return _.ok?{ok:!0,...a}:{ok:!1,message:a.message||r}}catch{return{ok:!1,message:r}}}function dt({id:e,token:t,set:n}){return m`<input
    id=${e}
    type="password"
    placeholder="gateway credential"
    value=${t}
    onInput=${o=>n(o.target.value)}
  />`}function T(e,t=2){return typeof e=="number"?e.toFixed(t):"\u2013"}function lt({title:e,points:t,series:n,unit:o}){let l=t.flatMap(p=>n.map(s=>p[s.key]||0)),c=Math.max(1e-9,...l)*1.1,i=p=>t.map((s,d)=>{let v=28+d/Math.max(1,t.length-1)*426,b=140-28/2-(s[p]||0)/c*112;return`${d?"L":"M"}${v.toFixed(1)},${b.toFixed(1)}`}).join(" "),u=t[t.length-1]||{};return m`<figure class="chart" data-chart=${e}>
    <figcaption>
      ${e}
      ${n.map(p=>m`<span class="legend" style=${`color:${p.color}`}
          >${p.label} ${T(u[p.key])} ${o}</span
        >`)}
    </figcaption>
    <svg viewBox=${"0 0 460 140"} role="img" aria-label=${e}>
      <text x="2" y="12" class="axis">${T(c,1)}</text>
      <text x="2" y=${136} class="axis">0</text>
      ${n.map(p=>m`<path d=${i(p.key)} fill="none" stroke=${p.color} stroke-width="1.8" />`)}
    </svg>
  </figure>`}function ne({agents:e}){return m`<section>
    <h2>Agents <small>${e.length}</small></h2>
    <table id="agents">
      <thead>
        <tr>
          <th>agent</th><th>types</th><th>health</th><th>HIGH</th><th>MEDIUM</th><th>LOW</th>
          <th>in flight</th><th>deferred</th><th>dead</th><th>address</th>
        </tr>
      </thead>
      <tbody>
        ${e.map(t=>m`<tr data-agent=${t.agent_id}>
            <td class="id">${t.agent_id}</td>
            <td>${t.agent_types.join(", ")}</td>
            <td class=${`health ${t.health}`}>${t.health}</td>
            <td>${t.high}</td><td>${t.medium}</td><td>${t.low}</td>
            <td>${t.in_flight}</td><td>${t.deferred}</td><td>${t.dead_letters}</td>
            <td class="addr">${t.address}${re(t)}</td>
          </tr>`)}
      </tbody>
    </table>
  </section>`}function re(e){return e.push_instances?e.push_instances===e.instances?" (push)":` (push: ${e.push_instances} of ${e.instances})`:""}function oe({workflows:e}){let t=[...e].reverse();return m`<section>
    <h2>Hand-off workflows <small>${e.length}</small></h2>
    ${t.length?m`<table id="workflows">
          <thead>
            <tr>
              <th>workflow</th><th>status</th><th>step</th><th>with</th><th>from</th>
              <th>task</th><th>handed off</th>
            </tr>
          </thead>
          <tbody>
            ${t.map(n=>m`<tr data-workflow=${n.workflow_id}>
                <td><code>${n.workflow_id}</code></td>
                <td>
                  <span class=${`status ${n.status}`} title=${n.error_reason}>${n.status}</span>
                </td>
                <td>${n.step}</td>
                <td class="id">${n.current_agent}</td>
                <td>${n.from_agent}</td>
                <td>${n.task_description}</td>
                <td>${n.handed_off_at&&new Date(n.handed_off_at).toLocaleTimeString()}</td>
              </tr>`)}
          </tbody>
        </table>`:m`<p class="note" id="workflows">none</p>`}
  </section>`}function se({trace:e}){if(!e)return null;if(!e.spans.length)return m`<p class="note">${e.note||"no spans"}</p>`;let t=new Set(e.critical_path),n=Math.max(e.total_ms,1e-6);return m`<div class="waterfall" id="waterfall">
    <p>${e.spans.length} spans, ${T(e.total_ms)} ms; critical path highlighted</p>
    ${e.spans.map(o=>m`<div class=${`span ${t.has(o.span_id)?"critical":""}`}
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
  </div>`}function _e(e,t){let n=T(t.accuracy*100,0);return`${e} accuracy ${n}% (${t.satisfied} of ${t.rated} rated runs)`}function ae({run:e,state:t}){let[n,o]=x(""),[_,r]=x(null);if(D(()=>r(null),[e.run_id]),!t.allow_runs||!["COMPLETED","PARTIAL"].includes(e.status))return null;let a=async l=>r(await ct(`/api/runs/${e.run_id}/feedback`,{satisfied:l},n));return m`<p id="feedback">
    Did this outcome satisfy you?
    ${t.credential_required&&m`<${dt} id="feedback-token" token=${n} set=${o} />`}
    <button id="satisfied" onClick=${()=>a(!0)}>Yes</button>
    <button id="not-satisfied" onClick=${()=>a(!1)}>No</button>
    ${_&&(_.ok?m`<span id="accuracy">${_e(e.pattern,_)}</span>`:m`<span class="error" id="feedback-error">${_.message}</span>`)}
  </p>`}function ie({run:e,events:t,state:n}){let[o,_]=x(null);return D(()=>_(null),[e.run_id]),m`<section id="run-detail" data-run=${e.run_id}>
    <h2>
      ${e.pattern} <code>${e.run_id}</code>
      <span class=${`status ${e.status}`}>${e.status}</span>
      <button
        id="show-trace"
        onClick=${async()=>_(await ut(`/api/traces/${e.run_id}`))}
      >
        Trace waterfall
      </button>
    </h2>
    <ol class="events">
      ${t.map(r=>m`<li class=${`event ${r.kind}`} data-kind=${r.kind}>
          <span class="kind">${r.kind}</span>
          ${r.agent_id&&m`<span class="agent">${r.agent_id}</span>`}
          <span class="summary">${r.summary}</span>
          <span class="ms">${T(r.elapsed_ms,1)} ms</span>
        </li>`)}
    </ol>
    <${ae} run=${e} state=${n} />
    <${se} trace=${o} />
  </section>`}function le({state:e,onStarted:t}){let[n,o]=x("group_chat"),[_,r]=x(JSON.stringify(Bt.group_chat,null,2)),[a,l]=x(""),[c,i]=x("");if(!e.allow_runs)return m`<section><p class="note">Read-only dashboard.</p></section>`;let u=s=>{o(s),r(JSON.stringify(Bt[s]||{},null,2))};return m`<section>
    <h2>Start a pattern</h2>
    <form id="start" onSubmit=${async s=>{s.preventDefault(),i("");let d;try{d=JSON.parse(_)}catch(b){i(`not JSON: ${b.message}`);return}let v=await ct(`/api/patterns/${n}`,d,a);if(!v.ok){i(v.message);return}t(v.run_id)}}>
      <select id="pattern" value=${n} onChange=${s=>u(s.target.value)}>
        ${e.patterns.map(s=>m`<option value=${s}>${s}</option>`)}
      </select>
      ${e.credential_required&&m`<${dt} id="token" token=${a} set=${l} />`}
      <textarea id="body" rows="8" value=${_} onInput=${s=>r(s.target.value)} />
      <button id="run" type="submit">Start</button>
      ${c&&m`<p class="error" id="start-error">${c}</p>`}
    </form>
  </section>`}function ue({state:e}){let[t,n]=x(null),[o,_]=x(""),[r,a]=x(null),l=async()=>n(await ut("/api/dead-letters"));D(()=>{l()},[]);let c=async u=>{let p={agent_id:u.to_agent,message_ids:[u.message_id]};a(await ct("/api/dead-letters/requeue",p,o)),await l()},i=e.allow_runs;return m`<section>
    <h2>Dead letters <button onClick=${l}>Refresh</button></h2>
    ${i&&e.credential_required&&m`<${dt} id="requeue-token" token=${o} set=${_} />`}
    ${r&&(r.ok?m`<p id="requeue-result">
          ${r.requeued} requeued${r.left?`, ${r.left} left (queue full)`:""}
        </p>`:m`<p class="error" id="requeue-result">${r.message}</p>`)}
    ${t&&(t.length?m`<table id="dead-letters">
          <thead>
            <tr>
              <th>message</th><th>from</th><th>to</th><th>reason</th><th>at</th>
              ${i&&m`<th></th>`}
            </tr>
          </thead>
          <tbody>
            ${t.map(u=>m`<tr>
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
  </section>`}function ce(){let[e,t]=x(null),[n,o]=x([]),[_,r]=x([]),[a,l]=x(null),[c,i]=x({}),[u,p]=x([]),[s,d]=x(!1);D(()=>{let f=new EventSource("/api/events");return f.addEventListener("open",()=>d(!0)),f.addEventListener("error",()=>d(!1)),f.addEventListener("state",h=>{let $=JSON.parse(h.data);t($),o($.history),r($.runs),p($.workflows||[])}),f.addEventListener("workflows",h=>p(JSON.parse(h.data))),f.addEventListener("workflow",h=>{let{key:$,row:S}=JSON.parse(h.data);p(C=>{let A=C.filter(U=>U.key!==$);return S?[...A,S].slice(-100):A})}),f.addEventListener("snapshot",h=>{let $=JSON.parse(h.data);t(S=>({...S,...$})),o(S=>[...S.slice(-299),$.point])}),f.addEventListener("event",h=>{let{run:$,event:S}=JSON.parse(h.data);r(C=>[$,...C.filter(A=>A.run_id!==$.run_id)].slice(0,50)),i(C=>({...C,[$.run_id]:[...C[$.run_id]||[],S]}))}),()=>f.close()},[]);let v=async f=>{l(f);try{let h=await ut(`/api/runs/${f}`);i($=>{let S=$[f]||[];return{...$,[f]:h.events.length>=S.length?h.events:S}})}catch{}},b=Ft(()=>_.find(f=>f.run_id===a),[_,a]);if(!e)return m`<p class="note">connecting…</p>`;let y=e.totals||{};return m`<main>
    <header>
      <h1>agentmesh</h1>
      <span id="live" class=${s?"live":"offline"}>${s?"live":"offline"}</span>
      <span>held <b>${y.held}</b></span>
      <span>sent <b>${y.sent_count}</b></span>
      <span>delivered <b>${y.delivered_count}</b></span>
      <span>expired <b>${y.expired_count}</b></span>
      <span>dead <b>${y.dead_lettered_count}</b></span>
      <span title="requests whose requester gave up">withdrawn <b>${y.withdrawn_count}</b></span>
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
    <${oe} workflows=${u} />
    <div class="columns">
      <section>
        <h2>Pattern runs</h2>
        <ul id="runs">
          ${_.map(f=>m`<li
              class=${`run ${f.run_id===a?"selected":""}`}
              data-run=${f.run_id}
              onClick=${()=>v(f.run_id)}
            >
              <span class="pattern">${f.pattern}</span> <code>${f.run_id}</code>
              <span class=${`status ${f.status}`}>${f.status}</span>
            </li>`)}
        </ul>
      </section>
      <${le} state=${e} onStarted=${v} />
    </div>
    ${b&&m`<${ie} run=${b} events=${c[b.run_id]||[]} state=${e} />`}
    <${ue} state=${e} />
  </main>`}Pt(m`<${ce} />`,document.getElementById("app"));
