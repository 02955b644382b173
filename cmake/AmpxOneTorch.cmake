# One LibTorch, not two. LibTorch's CMake config finds its pieces with CMake's
# own searches, which look in the system's folders before the config's own:
# on a machine with Debian's libtorch-dev, a pip wheel's TorchConfig.cmake
# (reached by Torch_DIR alone) takes Debian's libtorch.so (find_library) and
# Debian's Caffe2 config (find_dependency(Caffe2), which defines the imported
# `torch` target every program links). The program then compiles against the
# wheel's headers and links Debian's libraries: undefined at::_ops::...
# references, or a crash far from the cause.
#
#   include(AmpxOneTorch)
#   ampx_one_torch(message)   # after find_package(Torch); empty if all of it
#                             # lies under TORCH_INSTALL_PREFIX
#
# ampx's own build stops on a non-empty message; its installed config
# (ampxConfig.cmake) refuses find_package(ampx) with it.
function(ampx_one_torch out)
  set(${out} "" PARENT_SCOPE)
  if(NOT TORCH_INSTALL_PREFIX)
    return()
  endif()
  get_filename_component(prefix "${TORCH_INSTALL_PREFIX}" REALPATH)
  set(found "")
  if(TORCH_LIBRARY)
    list(APPEND found "TORCH_LIBRARY=${TORCH_LIBRARY}")
  endif()
  if(TARGET torch)
    get_target_property(imported torch IMPORTED)
    if(imported)
      get_target_property(configs torch IMPORTED_CONFIGURATIONS)
      set(props IMPORTED_LOCATION)
      if(configs)
        foreach(config IN LISTS configs)
          string(TOUPPER "${config}" config)
          list(APPEND props IMPORTED_LOCATION_${config})
        endforeach()
      endif()
      foreach(prop IN LISTS props)
        get_target_property(location torch ${prop})
        if(location)
          list(APPEND found "the torch target's ${prop}=${location}")
        endif()
      endforeach()
    endif()
  endif()
  foreach(entry IN LISTS found)
    string(REGEX REPLACE "^[^=]*=" "" path "${entry}")
    get_filename_component(real "${path}" REALPATH)
    string(FIND "${real}" "${prefix}/" at)
    if(NOT at EQUAL 0)
      set(from "")
      if(Caffe2_DIR)
        set(from " (its Caffe2 config came from Caffe2_DIR=${Caffe2_DIR})")
      endif()
      get_filename_component(cmake_prefix "${Torch_DIR}/.." ABSOLUTE)
      set(${out} "LibTorch's config at ${Torch_DIR} found ${entry}${from}, outside its own \
${TORCH_INSTALL_PREFIX}: another LibTorch is installed in a system folder, and a program \
would compile against one and link the other. Put ${cmake_prefix} in CMAKE_PREFIX_PATH \
(what torch.utils.cmake_prefix_path prints, for a pip wheel), pass \
-DCMAKE_LIBRARY_PATH=${TORCH_INSTALL_PREFIX}/lib, and start from an empty build folder."
        PARENT_SCOPE)
      return()
    endif()
  endforeach()
endfunction()
